"""Export a server checkpoint to a PEFT adapter directory:

    python -m archon.serve.export tinker://<model id>/<weights|sampler_weights>/<name> OUT_DIR [--checkpoint-dir D]

OUT_DIR then loads with `peft.PeftModel.from_pretrained(base, OUT_DIR)` on the server's base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro

from archon.serve.adapters import UserError, export_peft


@dataclass
class ExportConfig:
    path: tyro.conf.Positional[str]
    """The checkpoint's tinker:// path (what save_state / save_weights_for_sampler returned)."""
    out_dir: tyro.conf.Positional[str]
    """The PEFT directory to write (replaced whole if it exists)."""
    checkpoint_dir: str = "tinker_checkpoints"
    """The server's --checkpoint-dir."""


def main(argv: list[str] | None = None) -> None:
    config = tyro.cli(ExportConfig, args=argv)
    try:
        out = export_peft(Path(config.checkpoint_dir), config.path, Path(config.out_dir))
    except UserError as e:
        raise SystemExit(f"archon.serve.export: {e}") from None
    print(f"wrote the PEFT adapter of {config.path} to {out}")


if __name__ == "__main__":
    main()
