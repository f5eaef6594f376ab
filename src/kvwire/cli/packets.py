"""``kvwire inspect``: verify a packet file and show what it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from .console import out


@click.command("inspect")
@click.argument("packet_file", type=click.Path(path_type=Path))
@click.option("--key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="file holding the shared signing key (default: $KVWIRE_SIGNING_KEY)")
@click.option("--require-signature", is_flag=True, help="fail unless the packet is signed with the key")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def inspect_cmd(packet_file: Path, key_file: Path | None, require_signature: bool, as_json: bool) -> None:
    """Verify a packet file and print its metadata, encoding, signature and shapes."""
    from dataclasses import replace

    from ..wire import codec  # torch: imported once the command runs, not for --help or a usage error

    options = codec.CodecOptions.from_env()
    if key_file is not None:
        options = replace(options, key=key_file.read_bytes().strip())
    if require_signature and options.key is None:  # the options' own hint names the Python API's key=...
        raise click.UsageError("--require-signature needs the signing key: give --key-file FILE or set "
                               "KVWIRE_SIGNING_KEY")
    if require_signature:
        options = replace(options, require_signature=True)
    data = codec.map_file(packet_file, options.max_bytes)
    packet = codec.decode(data, options=options)  # verifies checksum and, with a key, the signature
    envelope = codec.peek(data, max_bytes=options.max_bytes)
    info = packet.describe()
    info["encoding"] = envelope.encoding
    info["encoded_bytes"] = envelope.encoded_bytes
    info["signature"] = {"signed": envelope.signed, "key_id": envelope.key_id,
                         "verified": envelope.signed and options.key_bytes is not None}
    if as_json:
        print(json.dumps(info))
        return
    table = Table(title=_shown(packet_file), show_header=False)
    for key, value in info.items():  # producer, session, spec strings come from the packet: Text, never markup
        if key == "spec":
            for name, field in value.items():
                table.add_row(f"spec.{name}", _shown(field))
        elif key == "signature":
            table.add_row(key, "none" if not value["signed"] else
                          f"key id {value['key_id']}, " + ("verified" if value["verified"] else
                                                          "NOT verified (no signing key configured)"))
        else:
            table.add_row(key, _shown(value))
    out.print(table)


def _shown(value: Any) -> Text:
    """A value from an untrusted packet as terminal text: control characters (escape sequences) escaped."""
    return Text("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value)))
