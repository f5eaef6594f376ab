"""Loading models and reading their cache spec (transformers side; RoPE tables: :mod:`.rotary`).

Never contacts a model hub: ``HF_HUB_OFFLINE`` is set before transformers is
imported and every load passes ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # kvwire never contacts a model hub

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ..allocator import trim_now  # noqa: E402
from ..errors import ContextTooLong, ModelError, reason  # noqa: E402
from ..wire.spec import DTYPES, ModelSpec, dtype_name, fingerprint  # noqa: E402

log = logging.getLogger(__name__)

_SUPPORTED_LAYERS = {DynamicLayer: "full_attention", DynamicSlidingWindowLayer: "sliding_attention"}

# The conversation format of a tokenizer without a chat template (a base model): "Role:" paragraphs,
# each closed by the tokenizer's eos token. kvwire tokenizes a transcript turn by turn, so every
# boundary between two pieces must tokenize the same apart as together: a special token on one side
# guarantees it, where plain newlines would not ("...\n" + "\n\n" is one token "\n\n\n" in many
# vocabularies, and GPT-2-style pre-tokenizers split "\n\nUser" as "\n", "\n", "User").
PLAIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ message['role'] | capitalize }}:\n{{ message['content'] }}"
    "{{ eos_token if eos_token else '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:\n{% endif %}"
)


# Special tokens that end a generation wherever a tokenizer has them (llama.cpp's end-of-generation set,
# which GGUF files are written for): a converted GGUF's generation config can list one of them alone
# (Qwen2.5-Instruct's names only <|im_end|>; upstream it also stops at <|endoftext|>).
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|end|>", "<eos>", "</s>")


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
               weights: str = "fp32", device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load a local HF model folder (never a hub id) as ``(model, tokenizer)`` in eval mode, its linear
    weights in the format ``weights`` (:mod:`.weights`), on ``device`` (both checked before any weights load:
    :func:`check_device`)."""
    from . import weights as weight_formats

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"no model folder at {path} (config.json missing)",
                         "pass a local HF model folder or a .gguf file")
    _check_folder(path)
    weight_formats.check_format(weights)
    from .devices import check_device

    where = check_device(device, weights)
    from .int8_product import wanted
    from .linears import policy
    from .step import enabled

    # a bad KVWIRE_LINEARS, KVWIRE_STEP or KVWIRE_INT8_KERNEL fails here, before the weights load, not mid-run
    wanted()
    log.debug("linear layers: %s policy (KVWIRE_LINEARS); decode step %s (KVWIRE_STEP)", policy().name,
              "on" if enabled() else "off")
    config = read_config(path)  # a damaged config.json is said before any weights load
    if weights != "fp32":
        if dtype != torch.float32:
            raise ModelError(f"--weights {weights} converts an fp32 model; this one is loaded as {dtype}",
                             "load it as float32, or use --weights fp32")
        weight_formats.check_convertible(config, weights)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a local load takes ~1 s; its bar is noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = load_compact(path, config, weights) if weights != "fp32" else None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
            weight_formats.convert(model, weights)
    except (OSError, ValueError, SafetensorError) as err:
        detail = " ".join(str(err).split())  # transformers' messages run over several lines
        raise ModelError(f"cannot load the model at {path}: {detail}", "check that the folder is complete") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    from .attention import adopt

    adopt(model)  # sdpa without its copies of grouped heads under a mask (the same bits)
    if where.type != "cpu":
        model.to(where)
    _align(model)
    _stop_at_every_end_of_generation(model, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        log.warning("%s has no chat template (a base model?): its conversations are written as plain "
                    "'Role:' paragraphs (hf.loading.PLAIN_CHAT_TEMPLATE)", path.name)
    return model, tokenizer


def load_compact(path: str | os.PathLike[str], config: Any, weights: str) -> Any | None:
    """The model at ``path`` with its linears in the compact format ``weights`` (:func:`.weights.convert`), read
    one tensor at a time: each linear's fp32 weights are read just before they are converted and dropped after,
    so the load never holds the fp32 model (transformers' own load does, and converting after it peaked at
    3.9-5.4 GB for Qwen2.5-Coder-0.5B, whose int8 model is 1.4 GB; BENCHMARKS section 13). The same
    parameters, bit for bit, as ``from_pretrained`` then ``convert`` (tested).

    ``None`` where the folder's safetensors do not name the model's parameters one to one (a checkpoint whose
    keys transformers renames, or that holds other tensors): the caller loads it the usual way then."""
    from transformers import GenerationConfig

    from . import weights as weight_formats
    from .embeddings import code_embeddings

    with contextlib.ExitStack() as stack:
        where = _open_checkpoints(stack, Path(path))
        if where is None:
            return None
        model = _model_on_meta(config)
        names = {id(module): name for name, module in model.named_modules()}
        embeddings = model.get_input_embeddings()
        tied = _tied_head(model, names, where)
        expected = _state_keys(model) - tied
        if set(where) != expected:
            log.debug("%s: the checkpoint's keys are not the model's (%d unknown, %d missing); loading the usual "
                      "way", path, len(set(where) - expected), len(expected - set(where)))
            return None

        def read(key: str) -> None:
            if key in where:
                _put(model, key, where.pop(key).read(key))

        filled = itertools.count()

        def fill(name: str, linear: torch.nn.Linear) -> None:
            if next(filled) % 8 == 0:  # the last linears' fp32 weights and temporaries: else resident, ~0.4 GB in
                trim_now()  # all (a trim costs ~3 ms: every linear's added 0.5 s to a 0.5B load)
            read(f"{name}.weight")
            read(f"{name}.bias")
            if f"{name}.weight" in tied:
                linear.weight = embeddings.weight

        if tied:  # the output layer is converted from them
            read(f"{names[id(embeddings)]}.weight")
        weight_formats.convert(model, weights, fill=fill)
        _read_coded_embeddings(model, f"{names[id(embeddings)]}.weight", where)
        for key in list(where):  # then what stays as it is: the embeddings (after the output layer's fp32 weights
            read(key)  # are gone: the two are the largest tensors), norms, any linears outside the layers
        code_embeddings(model)  # a table read whole (tied, or not fp32 on disk) that is exactly 8-bit block codes
    trim_now()
    unread = [name for name, param in model.named_parameters() if param.is_meta]
    if unread:
        raise ValueError(f"no weights were read for {', '.join(unread[:3])}")
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    model.config.name_or_path = str(path)
    return model


def _read_coded_embeddings(model: Any, key: str, where: dict[str, _Checkpoint]) -> None:
    """Read the input embeddings ``key`` a block of rows at a time into 8-bit block codes where they are exactly
    such codes (:mod:`.embeddings`; the fp32 table, 545 MB for Qwen2.5-Coder-0.5B, is never held whole); else
    leave ``key`` in ``where`` to be read as it is."""
    from .embeddings import CodedEmbedding, codes_by_rows, plain_table

    table = plain_table(model)
    checkpoint = where.get(key)
    if checkpoint is None or table is None:
        return
    dtype, shape, _, _ = checkpoint.entries[key]
    if dtype != torch.float32 or len(shape) != 2 or list(shape) != list(table.weight.shape):
        return
    found = codes_by_rows(lambda start, stop: checkpoint.read(key, start, stop), *shape)
    if found is not None:
        model.set_input_embeddings(CodedEmbedding(*found))
        del where[key]


class _Checkpoint:
    """A safetensors file whose tensors are read one at a time, on request, each into memory of torch's own.

    Not the safetensors library's reader: its mmap keeps every page it touched resident while the file is open
    (2.5 GB by the end of Qwen2.5-Coder-0.5B), and its pread gives memory on 16-byte boundaries, which
    :func:`_align` copies whole (the 545 MB embeddings, at the load's peak). The format is a little-endian u64
    header length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes; every entry is
    checked against the file before anything is read (a file the library would refuse may still be refused
    later, by transformers' own load)."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, file: Path) -> None:
        self.file = open(file, "rb")  # noqa: SIM115 -- closed by __exit__
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        self.unreadable = ""
        size = os.fstat(self.file.fileno()).st_size
        try:
            length = int.from_bytes(self.file.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(self.file.read(length))
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                dtype, shape, (begin, end) = self.DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
                nbytes = math.prod(shape) * dtype.itemsize
                if not 0 <= begin <= end <= size - 8 - length or end - begin != nbytes:
                    raise ValueError(f"{key}'s bytes {begin}..{end} do not hold {shape} {entry['dtype']}")
                self.entries[key] = (dtype, shape, 8 + length + begin, nbytes)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self.unreadable = f"not a safetensors file kvwire reads ({type(err).__name__}: {err})"

    def read(self, key: str, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor ``key``, or its rows ``first:stop`` (along its first dimension)."""
        dtype, shape, start, nbytes = self.entries[key]
        if first or stop is not None:
            row = nbytes // shape[0] if shape and shape[0] else 0
            stop = shape[0] if stop is None else min(stop, shape[0])
            shape = [max(0, stop - first), *shape[1:]]
            start, nbytes = start + first * row, shape[0] * row
        data = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < nbytes:  # a read returns at most ~2 GB on Linux: a 7B model's embeddings take two
            count = os.preadv(self.file.fileno(), [view[done:]], start + done)
            if count <= 0:
                raise ValueError(f"{key}: the file ends {nbytes - done} bytes before its last")
            done += count
        return data.view(dtype).reshape(shape)

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _open_checkpoints(stack: contextlib.ExitStack, path: Path) -> dict[str, _Checkpoint] | None:
    """Every tensor name in the folder's safetensors, with the file it is read from (open until ``stack`` closes);
    ``None`` where a file is not one kvwire reads (said in the debug log)."""
    where = {}
    for file in sorted(path.glob("*.safetensors")):
        checkpoint = stack.enter_context(_Checkpoint(file))
        if checkpoint.unreadable:
            log.debug("%s: %s; loading the usual way", file, checkpoint.unreadable)
            return None
        where.update(dict.fromkeys(checkpoint.entries, checkpoint))
    return where


def _tied_head(model: Any, names: dict[int, str], where: dict[str, Any]) -> set[str]:
    """``{the output layer's weight name}`` where it is the input embeddings (tied, and absent from the checkpoint);
    else empty. Keeps no reference to the layer: held, its fp32 weights would outlive its conversion."""
    head = model.get_output_embeddings()
    key = f"{names[id(head)]}.weight" if head is not None else ""
    tied = type(head) is torch.nn.Linear and key not in where and getattr(
        model.config.get_text_config(decoder=True), "tie_word_embeddings", False)
    return {key} if tied else set()


def _model_on_meta(config: Any) -> Any:
    """The model of ``config`` with every parameter a shape on the meta device, its buffers (RoPE's tables) as
    its modules computed them. Made in memory that is never written and given back before any weight is read:
    a read that reused one of those untouched chunks would make it resident, and chunk by chunk the whole fp32
    model with it."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                module._parameters[attr] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    return model


def _state_keys(model: Any) -> set[str]:
    """The names a checkpoint of ``model`` holds: its parameters and persistent buffers, shared ones by every name."""
    keys = {key for key, _ in (*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False))}
    return keys - {f"{name}.{attr}" for name, module in model.named_modules()
                   for attr in module._non_persistent_buffers_set}


def _put(model: Any, key: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` (cast to the place's dtype) the parameter or buffer ``key`` of ``model``."""
    owner, _, attr = key.rpartition(".")
    module = model.get_submodule(owner)
    old = module._parameters[attr] if attr in module._parameters else module._buffers[attr]
    if tensor.shape != old.shape:
        raise ValueError(f"{key} is {tuple(tensor.shape)} in the checkpoint, {tuple(old.shape)} in the model")
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(tensor.to(old.dtype), requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = tensor.to(old.dtype)


def _stop_at_every_end_of_generation(model: Any, tokenizer: Any) -> None:
    """Add the tokenizer's special tokens of :data:`END_OF_GENERATION` to the generation config's eos ids
    (:func:`eos_token_ids` reads them there), keeping the ids it lists."""
    from .tokens import special_tokens

    special = special_tokens(tokenizer)
    extra = {special[name] for name in END_OF_GENERATION if name in special}
    listed = eos_token_ids(model)
    if listed and not extra <= listed:
        model.generation_config.eos_token_id = sorted(listed | extra)
        log.debug("eos ids: %s (generation config: %s)", sorted(listed | extra), sorted(listed))


def context_window(model: Any) -> int | None:
    """The most positions the model was made for (``max_position_embeddings``), or ``None`` if it does not say."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "max_position_embeddings", None)
    return int(window) if window else None


# what a tokenizer is read from: one of these must be in a model folder
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tiktoken.model")


def _check_folder(path: Path) -> None:
    """A folder with a config but no weights or no tokenizer is refused naming what is missing (transformers
    says it in five lines about backends and slow tokenizers). kvwire reads weights from safetensors only."""
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in (*path.glob("*.bin"), *path.glob("*.pt"), *path.glob("*.pth")))
        raise ModelError(f"{path} has a config.json but no weights (*.safetensors)"
                         + (f"; {', '.join(pickled[:3])} would need pickle, which kvwire never loads" if pickled
                            else ""),
                         "copy the model's .safetensors files into the folder, or pass the model's .gguf file")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"{path} has weights but no tokenizer (none of {', '.join(_TOKENIZER_FILES)})",
                         "copy the model's tokenizer files into the folder")


def model_device(model: Any) -> torch.device:
    """The device ``model``'s weights are on: where its inputs and caches must be (CPU for a model with none)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def model_dtype(model: Any) -> torch.dtype:
    """The dtype ``model`` computes in: its first floating-point parameter's (fp32 for a model with none). Not
    ``next(model.parameters()).dtype``: a compact model's first parameters may be int8 codes (its embeddings,
    :mod:`.embeddings`), which would make every cache and buffer sized from it int8."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_fits(model: Any, end: int, what: str = "the context") -> None:
    """Raise :class:`ContextTooLong` if positions up to ``end`` (exclusive: the context's last position + 1
    plus the tokens to generate) do not fit the model's context window."""
    window = context_window(model)
    if window is not None and end > window:
        raise ContextTooLong(f"{what} needs {end:,} positions, past the model's context window of {window:,}",
                             "shorten the input (or the conversation), or lower max_new_tokens")


def _align(model: Any) -> int:
    """Move parameters that do not start on a 64-byte boundary into memory that does (torch's own
    allocation); returns how many moved. Weights read from a safetensors file can start anywhere (the
    file's header sets the offset). Measured on the default model (2-core Xeon): the layers' matrix
    products 5-7 % faster, a whole one-row decode step ~2 %. Same values, same tied parameters."""
    moved = 0
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu" and param.data_ptr() % 64:
                param.data = param.data.clone(memory_format=torch.contiguous_format)
                moved += 1
    return moved


def convert_gguf(gguf_file: Path, out_dir: Path, *, progress_bars: bool = True) -> Path:
    """Dequantize a GGUF file to a safetensors model folder (fp32) at ``out_dir``.

    Slow (transformers dequantizes every tensor; ~20 s for the default model, ~1-2 min
    for Qwen2.5-0.5B) and done once; the folder is written under a temporary name and
    renamed into place. ``progress_bars=False`` silences transformers' own bars (for a
    caller that shows its own).
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelError(f"no GGUF file at {gguf_file}", "check the path")
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    _remove_orphans(out_dir)
    bars = hf_logging.is_progress_bar_enabled()
    if not progress_bars:
        hf_logging.disable_progress_bar()
    try:
        log.info("converting %s to %s (one time)", gguf_file, out_dir)
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                      local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                         dtype=torch.float32, local_files_only=True)
        except Exception as err:  # noqa: BLE001 -- a damaged file fails anywhere in the GGUF parsers (struct.error,
            # KeyError, IndexError, UnicodeDecodeError, ...): each is the same finding about the file, said once
            kind = type(err).__qualname__
            kind = kind if type(err).__module__ == "builtins" else f"{type(err).__module__}.{kind}"
            detail = str(err).splitlines()[0][:300] if str(err) else "no message"
            raise ModelError(f"cannot convert {gguf_file}: it is truncated, damaged or not a GGUF model "
                             f"transformers can read ({kind}: {detail})",
                             "check the file is a complete GGUF model: compare its size with the source's") from None
        # transformers refuses to save a GGUF-loaded model while it still looks quantized
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        try:  # the file was read: a failure from here on is the destination's (a full disk, a folder in the way)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            try:
                tmp.rename(out_dir)
            except OSError:
                if not (out_dir / "config.json").is_file():  # not a concurrent conversion that won
                    raise
        except OSError as err:
            in_the_way = out_dir.exists() and not (out_dir / "config.json").is_file()
            raise ModelError(f"cannot write the conversion of {gguf_file.name} to {out_dir}: "
                             + ("a folder without config.json is already there" if in_the_way
                                else reason(err) + (f" ({err.filename})" if err.filename else "")),
                             f"remove {out_dir} and run again" if in_the_way else
                             "free some disk space, or set KVWIRE_HOME to a folder kvwire may write to") from None
        except (ValueError, RuntimeError) as err:  # transformers read the model but will not save it as it is
            raise ModelError(f"cannot save the model read from {gguf_file.name} as safetensors: "
                             f"{str(err).splitlines()[0][:300] if str(err) else type(err).__name__}",
                             "pass a local HF model folder of the same model instead") from None
    finally:
        if bars and not progress_bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _remove_orphans(out_dir: Path) -> None:
    """Remove what conversions of ``out_dir`` killed mid-way left (``.NAME.PID.tmp`` of a process that is gone):
    never taken for a model, but hundreds of MB each. A running conversion's folder is left alone."""
    for orphan in out_dir.parent.glob(f".{out_dir.name}.*.tmp"):
        pid = orphan.name[len(out_dir.name) + 2: -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(orphan, ignore_errors=True)
        except OSError:  # alive, under another user: not ours to remove
            continue


def config_spec(config: Any, dtype: torch.dtype = torch.float32) -> ModelSpec:
    """The cache spec a model with this HF config has, without weights (fingerprint ``""``).

    Layer kinds come from the layers ``DynamicCache(config=...)`` builds, so they follow
    transformers' own rules (``layer_types``, ``sliding_window``).
    """
    text_config = config.get_text_config(decoder=True)
    layers = DynamicCache(config=config).layers
    kinds = []
    windows = set()
    for index, layer in enumerate(layers):
        kind = _SUPPORTED_LAYERS.get(type(layer))
        if kind is None:
            raise ModelError(f"{text_config.model_type} models use {type(layer).__name__} cache layers "
                             f"(layer {index})", "kvwire supports full and sliding-window attention caches")
        kinds.append(kind)
        if kind == "sliding_attention":
            windows.add(layer.sliding_window)
    if len(windows) > 1:
        raise ModelError(f"{text_config.model_type} mixes sliding windows {sorted(windows)}")
    if dtype_name(dtype) not in DTYPES:
        raise ModelError(f"model dtype {dtype_name(dtype)} is not supported", f"load it as one of {sorted(DTYPES)}")
    try:
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        vocab_size = text_config.vocab_size
    except (AttributeError, RuntimeError, TypeError) as err:  # per-layer heads/sizes (heterogeneous configs)
        raise ModelError(f"cannot read the cache shape of {text_config.model_type} models: {err}",
                         "kvwire supports models with one head count and head size for every layer") from None
    return ModelSpec(
        architecture=(getattr(config, "architectures", None) or [text_config.model_type])[0],
        model_type=text_config.model_type,
        num_layers=len(layers),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(dtype),
        vocab_size=vocab_size,
        layer_kinds=tuple(kinds),
        sliding_window=windows.pop() if windows else None,
        rope=_jsonable(getattr(text_config, "rope_parameters", None) or {}),
    )


def read_config(path: str | os.PathLike[str]) -> Any:
    """The HF config of the local model folder at ``path``, or one :class:`ModelError` naming the folder."""
    try:
        return AutoConfig.from_pretrained(Path(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 -- a config.json that is not JSON, lacks model_type, or holds values
        # its config class cannot take fails anywhere in transformers (ValueError, ZeroDivisionError for 0 heads,
        # huggingface_hub's StrictDataclassError for a string where a number goes, ...): the same finding
        detail = " ".join(str(err).split())[:300] or type(err).__name__  # transformers' can run to 3,000 chars
        raise ModelError(f"cannot read the model config in {path}: {detail}",
                         "check its config.json: it must be the model's own, as its publisher wrote it") from None


def spec_from_pretrained(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                         weights: str = "fp32") -> ModelSpec:
    """The cache spec of a local model folder, read from its config alone (no weights loaded)."""
    return replace(config_spec(read_config(path), dtype), weights=weights)


def model_spec(model: Any) -> ModelSpec:
    """A loaded model's cache spec, with its weights' fingerprint (~70 ms per 135M parameters)."""
    from .weights import format_of

    spec = replace(config_spec(model.config, model_dtype(model)), weights=format_of(model))
    fields = {k: v for k, v in spec.to_json().items() if k != "fingerprint"}
    return replace(spec, fingerprint=fingerprint(fields, model.named_parameters()))


def eos_token_ids(model: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config (a GGUF tokenizer's eos can be wrong)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
