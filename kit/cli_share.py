"""`kit export`, `kit merge`, `kit resize` and `kit push`: what leaves a run, as commands.

Part of the command line (`kit.cli` adds these to its parser); like it, each command imports
what it uses when it runs, so that `kit --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from kit.errors import KitError


def cmd_export(args: argparse.Namespace) -> int:
    from kit.config import load_config
    from kit.export.writer import formats_for
    from kit.families import get_family
    from kit.run.folder import open_run
    from kit.run.lock import hold_run

    formats = args.format
    if not formats:
        cfg = load_config(open_run(args.run_dir).config)
        formats = formats_for(cfg, get_family(cfg.model.model_family, cfg))
    with hold_run(open_run(args.run_dir).root, "export"):  # not while the run trains
        return _export_each(args, formats)


def _export_each(args: argparse.Namespace, formats: list[str]) -> int:
    from kit.export.writer import export

    failed = []
    # Each format is written and checked on its own: one that fails does not keep the next
    # from being written.
    for fmt in formats:
        try:
            r = export(
                args.run_dir,
                fmt,
                checkpoint=args.checkpoint,
                dtype=args.dtype,
                verify=not args.no_verify,
            )
        except KitError as e:
            print(f"{fmt}: failed: {e}", file=sys.stderr)
            failed.append(fmt)
            continue
        v = r.verification
        # Each file of a denoiser of several models on its own lines: its checks, its clients.
        for path, each in [(r.files[p], r.verifications.get(p)) for p in r.files] or [(r.path, v)]:
            print(f"{fmt}: {path} (step {r.step}; {each.describe() if each else 'not verified'})")
            if each and each.use_in:
                print(f"  for: {'; '.join(each.use_in)}")
        for note in v.notes if v else []:
            print(f"  note: {note}")
    return 2 if failed else 0


def cmd_share(args: argparse.Namespace) -> int:
    """`kit resize`, `push`, `merge`: call the `kit.export` function with the options listed in
    `keys` (one not given keeps the function's default); print the result."""
    from kit.export import merge, push, resize
    from kit.run.folder import open_run
    from kit.run.lock import hold_run

    work = {"resize": resize.resize, "push": push.push, "merge": merge.merge}[args.command]
    kw = {k: v for k in args.keys if (v := getattr(args, k)) is not None}
    if args.command == "push":
        r = work(args.run_dir, **kw)
    else:  # they read the run's checkpoints: not while it trains
        with hold_run(open_run(args.run_dir).root, args.command):
            r = work(args.run_dir, **kw)
    if hasattr(r, "lines"):
        print("\n".join(r.lines()))
    else:
        print(f"{r.format}: {r.path} (step {r.step}, verified: max diff {r.max_abs_diff:g})")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the sharing commands to the `kit` parser's subcommands."""
    sp = sub.add_parser("export", help="export a run's adapter and verify it")
    sp.add_argument("run_dir")
    sp.add_argument(
        "--format",
        nargs="+",
        choices=["diffusers", "kohya", "embedding"],
        help="default: every format the run's network and family offer",
    )
    sp.add_argument("--checkpoint", help="checkpoint folder (default: the latest)")
    sp.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    sp.add_argument("--no-verify", action="store_true", help="skip the reload check")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("resize", help="shrink a LoRA's rank by SVD (DoRA, LoHa, LoKr: to LoRA)")
    sp.add_argument("run_dir")
    sp.add_argument("--rank", type=int, required=True)
    sp.add_argument("--out", dest="out_dir", help="the resized run's folder (default: beside it)")
    sp.set_defaults(func=cmd_share, keys=("rank", "out_dir"))

    sp = sub.add_parser("push", help="upload a run's exports, model card and samples to the hub")
    sp.add_argument("run_dir")
    sp.add_argument("--repo", required=True, help="hub repository: user/name")
    sp.add_argument("--dry-run", action="store_true", help="write the folder, upload nothing")
    sp.add_argument("--out", dest="out_dir", help="folder to assemble in (dry run: exports/hub)")
    sp.add_argument("--private", action="store_true", help="create the repository private")
    sp.add_argument("--license", help="hub license id (default: the base model's, else other)")
    sp.set_defaults(func=cmd_share, keys=("repo", "dry_run", "out_dir", "private", "license"))

    sp = sub.add_parser("merge", help="merge a run into its base model: one checkpoint, verified")
    sp.add_argument("run_dir")
    sp.add_argument("--out", required=True, help="the .safetensors file (diffusers: a folder)")
    sp.add_argument("--scale", type=float, help="adapter strength (default 1)")
    sp.add_argument("--format", dest="fmt", choices=["single_file", "diffusers"])
    sp.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="default: fp16")
    sp.add_argument(
        "--force", action="store_true", default=None, help="merge even if the base has changed"
    )
    sp.set_defaults(func=cmd_share, keys=("out", "scale", "fmt", "dtype", "force"))
