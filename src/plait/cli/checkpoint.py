"""`plait checkpoint`: look inside a saved checkpoint, or export its model as one file.

`inspect PATH` prints the step, world size, plan, whether the manifest verifies, and what
the model and optimizer state hold (read from the metadata; no tensor is loaded); `--json`
prints the same as one JSON object. It exits 1 when the checkpoint fails verification, so a
script can check one. `export PATH --out FILE` writes the whole model as a plain state dict
(`.safetensors`, or `torch.save` for any other name) that the plain model loads with
`load_state_dict`, whatever layout saved it, with the model's config beside it
(`FILE.json`; `plait.models.record.load_exported(FILE)` rebuilds the model from the two).
`export PATH --format hf --out DIR` writes a Hugging Face folder instead (config.json and
model.safetensors under transformers' names) that `AutoModelForCausalLM.from_pretrained(DIR)`
loads: hf-gpt2, hf-llama and plait's GPT (as GPT-2). A path that is not a checkpoint exits 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "summary"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "checkpoint",
        help="inspect a saved checkpoint or export its model as one file",
        description=(__doc__ or "").split("\n\n")[1],
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = actions.add_parser("inspect", help="summarise a checkpoint (exit 1 if it is damaged)")
    i.add_argument("path", metavar="PATH", help="a checkpoint folder, step-NNNNNNNN")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=_inspect)
    e = actions.add_parser(
        "export", help="write the model as one .safetensors or .pt file, or a Hugging Face folder"
    )
    e.add_argument("path", metavar="PATH", help="a checkpoint folder, step-NNNNNNNN")
    e.add_argument(
        "--out",
        required=True,
        metavar="FILE|DIR",
        help="FILE.safetensors or FILE.pt (--format plait), a folder (--format hf)",
    )
    e.add_argument(
        "--format",
        choices=("plait", "hf"),
        default="plait",
        help="plait: one state dict under plait's names, its config in FILE.json; hf: a folder "
        "transformers' from_pretrained loads (default: plait)",
    )
    e.set_defaults(func=_export)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _dtypes(group: dict[str, Any]) -> str:
    return ", ".join(f"{n} {dtype}" for dtype, n in sorted(group["dtypes"].items()))


def summary(d: dict[str, Any]) -> list[str]:
    """The readable lines of `describe`'s dict."""
    plan = " ".join(f"{k}={v}" for k, v in (d["plan"] or {}).items()) or "not recorded"
    verified = "OK" if d["verified"] else f"FAILED: {d['problem']}"
    lines = [
        f"checkpoint {d['path']}",
        f"  step        {d['step']}",
        f"  world size  {d['world_size'] if d['world_size'] is not None else 'not recorded'}",
        f"  plan        {plan}",
        f"  verified    {verified}",
    ]
    model, optim = d["model"], d["optim"]
    if model is None or optim is None:
        lines.append("  state       unreadable metadata")
    else:
        lines += [
            f"  model       {model['tensors']} tensors, {model['parameters']:,} parameters, "
            f"{_size(model['bytes'])} ({_dtypes(model)})",
            f"  optimizer   {optim['tensors']} tensors, {_size(optim['bytes'])}, "
            f"{optim['values']} other values",
            f"  rng states  {d['rng_states']}",
        ]
    lines.append(f"  on disk     {_size(d['disk_bytes'])} in {len(d['files'])} files")
    lines += [f"    {name:<24} {_size(size):>10}" for name, size in d["files"].items()]
    return lines


def _inspect(args: argparse.Namespace) -> int:
    from plait.checkpoint.inspect import describe

    d = describe(args.path)
    print(json.dumps(d) if args.json else "\n".join(summary(d)))
    return 0 if d["verified"] else 1


def _export(args: argparse.Namespace) -> int:
    from plait.checkpoint.inspect import export_model

    if args.format == "hf":
        from plait.checkpoint.hf_export import export_hf

        folder = export_hf(args.path, args.out)
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        print(f"wrote {folder} ({_size(size)}): the model of {args.path}, Hugging Face format")
        return 0
    out = export_model(args.path, args.out)
    print(f"wrote {out} ({_size(out.stat().st_size)}): the model of {args.path}")
    return 0
