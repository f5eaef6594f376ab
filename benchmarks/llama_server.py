"""llama.cpp's ``llama-server``, the peer of ``kvwire serve`` on a CPU: found or built once, then run.

    python benchmarks/llama_server.py [--build] [--print-path]

Where the binary comes from, in this order:
1. ``--llama-server PATH`` (or ``KVWIRE_LLAMA_SERVER``): a binary of your own;
2. ``llama-server`` on ``PATH``;
3. one built earlier into kvwire's cache folder (``~/.cache/kvwire/llama-server/<version>/``, never the repo);
4. else it is built there, from the llama.cpp source that the pinned ``llama-cpp-python`` sdist vendors
   (``pip download`` from PyPI: no other network), with ``cmake`` (the one on PATH, else PyPI's ``cmake``
   wheel installed into this Python) and the C++ compiler on PATH. Only the ``llama-server`` target, no web UI,
   no TLS, ggml without ``-march=native`` (AMX off: a native build segfaulted in a VM, see the Makefile), the
   x86 extensions this CPU lists. 18 minutes on a 2-core AMD EPYC with the test suite running beside it
   (BENCHMARKS section 13); its time is kept in ``build.json`` beside the binary.

A missing compiler, a failed download or a failed build is one line saying what to install or read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import die_with_parent  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built; pyproject's bench-llama extra pins it too
BINARY = "llama-server"


class PeerError(SystemExit):
    """One line for the user: what went wrong and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"llama-server: {message}")


def cache_folder() -> Path:
    if str(ROOT / "src") not in sys.path:  # run as a script from a checkout that is not installed
        sys.path.insert(0, str(ROOT / "src"))
    from kvwire import models

    return models.home() / "llama-server" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def find(explicit: str | None = None, build: bool = True, log=sys.stderr) -> Path:
    """The ``llama-server`` binary to run (see the module docstring for the order)."""
    explicit = explicit or os.environ.get("KVWIRE_LLAMA_SERVER")
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PeerError(f"{path} is not an executable file (--llama-server / KVWIRE_LLAMA_SERVER)")
        return path
    on_path = shutil.which(BINARY)
    if on_path:
        return Path(on_path)
    built = cache_folder() / BINARY
    if built.is_file():
        return built
    if not build:
        raise PeerError(f"not built yet: run python benchmarks/llama_server.py --build (it goes to {built.parent})")
    return build_server(cache_folder(), log)


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise PeerError("no C++ compiler on PATH (c++, g++ or clang++): install one (Debian: apt-get install g++), "
                    "or pass --llama-server PATH to a binary you have")


def _cmake(log) -> str:
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    print("llama-server: no cmake on PATH; installing PyPI's cmake wheel into this Python", file=log, flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], capture_output=True, text=True)
    found = shutil.which("cmake", path=str(Path(sys.executable).parent))
    if done.returncode or not found:
        raise PeerError(f"cmake is missing and pip could not install it ({_last_line(done.stderr)}): "
                        "install cmake (pip install cmake, or apt-get install cmake)")
    return found


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _flag(name: str) -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "OFF"
    return "ON" if re.search(rf"\b{name}\b", flags) else "OFF"


def cmake_options() -> list[str]:
    """The build's options: the server alone, no UI, no TLS, portable ggml with this CPU's x86 extensions."""
    return ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", f"-DGGML_AVX2={_flag('avx2')}", f"-DGGML_FMA={_flag('fma')}",
            f"-DGGML_F16C={_flag('f16c')}", f"-DGGML_AVX512={_flag('avx512f')}",
            f"-DGGML_AVX512_VNNI={_flag('avx512_vnni')}", f"-DGGML_AVX512_BF16={_flag('avx512_bf16')}",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def build_server(folder: Path, log=sys.stderr) -> Path:
    """Build ``llama-server`` into ``folder`` from the pinned sdist's vendored llama.cpp; the binary's path.
    Nothing is left in ``folder`` unless the build succeeded."""
    compiler = _compiler()
    cmake = _cmake(log)
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".llama-server-", dir=folder.parent) as tmp:
        work = Path(tmp)
        print(f"llama-server: fetching llama-cpp-python=={LLAMA_CPP_PYTHON}'s source from PyPI", file=log, flush=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)], capture_output=True, text=True)
        archives = list(work.glob("llama_cpp_python-*.tar.gz"))
        if got.returncode or not archives:
            raise PeerError(f"could not download llama-cpp-python=={LLAMA_CPP_PYTHON}'s sdist from PyPI "
                            f"({_last_line(got.stderr)})")
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name]
            archive.extractall(work / "src", members=members, filter="data")
        source = next((work / "src").glob("*/vendor/llama.cpp"), None)
        if source is None or not (source / "tools" / "server").is_dir():
            raise PeerError(f"llama-cpp-python=={LLAMA_CPP_PYTHON}'s sdist holds no llama.cpp server source")
        build = work / "build"
        jobs = str(os.cpu_count() or 1)
        print(f"llama-server: building with {Path(compiler).name} and {jobs} jobs (15-20 minutes on 2 cores)",
              file=log, flush=True)
        env = {**os.environ, "CXX": compiler}
        for step in ([cmake, "-S", str(source), "-B", str(build), "-G", "Ninja" if shutil.which("ninja") else
                      "Unix Makefiles", *cmake_options()],
                     [cmake, "--build", str(build), "--target", BINARY, "-j", jobs]):
            done = subprocess.run(step, capture_output=True, text=True, env=env)
            if done.returncode:
                (folder.parent / "build-failed.log").write_text(done.stdout + done.stderr)
                raise PeerError(f"the build failed ({_last_line(done.stderr or done.stdout)}); the whole log is in "
                                f"{folder.parent / 'build-failed.log'}")
        binary = next(build.rglob(BINARY), None)
        if binary is None or not binary.is_file():
            raise PeerError(f"the build finished but left no {BINARY} binary")
        staged = work / "out"
        staged.mkdir()
        shutil.copy2(binary, staged / BINARY)
        (staged / "build.json").write_text(json.dumps({
            "llama_cpp_python": LLAMA_CPP_PYTHON, "build_s": round(time.perf_counter() - start, 1),
            "cores": os.cpu_count(), "options": cmake_options(), "version": version(staged / BINARY)}))
        shutil.rmtree(folder, ignore_errors=True)
        staged.rename(folder)  # whole or not at all
    print(f"llama-server: built in {time.perf_counter() - start:.0f} s into {folder}", file=log, flush=True)
    return folder / BINARY


def version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    text = (done.stdout + done.stderr).strip()
    found = re.search(r"version: (\S+.*)", text)
    return found.group(1).strip() if found else _last_line(text)


class LlamaServer:
    """``llama-server`` on ``gguf`` in its own process group on loopback, ready when ``/health`` says ok."""

    def __init__(self, binary: Path, gguf: Path, workdir: Path, *, slots: int, context: int, threads: int,
                 cache_reuse: int = 256, port: int = 0) -> None:
        if not gguf.is_file():
            raise PeerError(f"no GGUF at {gguf}")
        self.port = port or _free_port()
        self.log = workdir / f"llama-server-{time.time_ns()}.log"
        # -c is the whole context, split across the -np slots: each slot gets `context`
        self.args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(context * slots),
                     "--cache-reuse", str(cache_reuse), "--no-warmup", "--metrics", "--jinja"]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise PeerError(f"it exited with {self.process.returncode} before it was ready: "
                                f"{_last_line(self.log.read_text(errors='replace'))} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=5) as response:
                    if json.loads(response.read() or b"{}").get("status") == "ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PeerError(f"not ready after 300 s (log: {self.log})")
            time.sleep(0.1)
        self.model = "llama-server"

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 15)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, 9)
                except ProcessLookupError:
                    pass
                self.process.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=None, help="a binary of your own (else PATH, else built)")
    parser.add_argument("--build", action="store_true", help="build into the cache folder even if one is on PATH")
    args = parser.parse_args()
    binary = build_server(cache_folder()) if args.build else find(args.llama_server)
    print(binary)
    print(version(binary))


if __name__ == "__main__":
    main()
