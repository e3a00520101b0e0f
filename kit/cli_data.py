"""`kit captions` and `kit caption`: reading, editing and drafting captions, as commands.

Part of the command line (`kit.cli` adds these to its parser); like it, each command imports
what it uses when it runs, so that `kit --help` stays fast. The helpers every command shares
(`config_of`, `print_json`) live here too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kit.errors import KitError


def print_json(obj: Any) -> None:
    """Print as indented JSON (paths and other objects as strings)."""
    print(json.dumps(obj, indent=2, default=str))


def config_of(args: argparse.Namespace):
    """The command's config file, with its `-s KEY=VALUE` overrides."""
    from kit.config import load_config, parse_override

    overrides = dict(parse_override(s) for s in getattr(args, "set", None) or [])
    return load_config(args.config, overrides)


def cmd_captions(args: argparse.Namespace) -> int:
    from kit.data.captions import Edit, caption_report

    cfg = config_of(args)
    if args.restore:
        return _restore_captions(cfg, args)
    edit = Edit(
        replace=tuple(args.replace) if args.replace else None,
        regex=args.regex,
        strip=args.strip,
        normalize=args.normalize,
        prepend=args.prepend or "",
        append=args.append or "",
    )
    if not edit.empty():
        return _edit_captions(cfg, edit, args)
    if args.apply:
        raise KitError(
            "--apply needs an edit: --prepend, --append, --replace, --strip or --normalize"
        )
    rep = caption_report(cfg)
    if args.json:
        print_json(rep)
        return 0
    print(f"{rep['images']} images, {rep['captioned']} captioned")
    for key in (
        "missing_captions",
        "orphan_captions",
        "empty_captions",
        "unreadable",
        "duplicate_captions",
        "duplicate_stems",
    ):
        if rep[key]:
            print(f"{key}: {len(rep[key])} (first: {rep[key][0]})")
    print("most common words:", ", ".join(f"{w} ({n})" for w, n in rep["top_words"][:15]))
    if rep["tagged_captions"]:
        print("most common tags:", ", ".join(f"{t} ({n})" for t, n in rep["top_tags"][:15]))
    for word, share in rep["trigger_coverage"].items():
        missing = rep["trigger_missing"][word]
        first = f" (missing in {len(missing)}, first: {missing[0]})" if missing else ""
        print(f"trigger word '{word}' in {share:.0%} of captions{first}")
    for line in rep.get("truncation_warnings", []):
        print(f"truncated: {line}")
    return 0


def _edit_captions(cfg, edit, args: argparse.Namespace) -> int:
    """Show a bulk edit as a diff; write it (after a backup) only with --apply."""
    from kit.data.captions import apply_edit, diff_text, plan_edit

    changes = plan_edit(cfg, edit)
    backup = apply_edit(cfg, changes) if args.apply and changes else None
    if args.json:
        print_json(
            {
                "changes": [{"file": str(c.path), "old": c.old, "new": c.new} for c in changes],
                "applied": backup is not None,
                "backup": str(backup) if backup else None,
            }
        )
        return 0
    sys.stdout.write(diff_text(changes))
    if not changes:
        print("no caption file would change")
    elif backup:
        print(f"changed {len(changes)} caption file(s); the old ones are backed up in {backup}")
    else:
        print(f"{len(changes)} caption file(s) would change (dry run); add --apply to write them")
    return 0


def _restore_captions(cfg, args: argparse.Namespace) -> int:
    """Put a caption backup back; the captions it replaces are backed up first."""
    from kit.data.captions import restore_backup

    before = restore_backup(cfg, args.restore)
    print(f"restored captions from {args.restore}; the replaced ones are backed up in {before}")
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    """Caption the images with a tagger or a captioning model: a diff, written only with --apply."""
    from kit.data.captioners import CaptionOptions, caption_dataset

    keys = (
        "prefix",
        "general_threshold",
        "character_threshold",
        "max_tags",
        "exclude_tags",
        "max_new_tokens",
        "task",
    )
    given = {k: getattr(args, k) for k in (*keys, "batch_size") if getattr(args, k) is not None}
    opts = CaptionOptions(overwrite=args.overwrite, **given)
    run = caption_dataset(
        config_of(args), args.captioner, args.model, opts, args.device, args.apply
    )
    sys.stdout.write(run.diff())
    print(run.summary())
    return 0


def add_commands(
    sub: argparse._SubParsersAction, with_config: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add the caption commands to the `kit` parser's subcommands."""
    sp = sub.add_parser(
        "captions", help="report on the dataset's captions, or bulk-edit them (dry run by default)"
    )
    with_config(sp)
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--prepend", metavar="WORD", help="put WORD first where a caption lacks it")
    sp.add_argument("--append", metavar="WORD", help="put WORD last where a caption lacks it")
    sp.add_argument("--replace", nargs=2, metavar=("OLD", "NEW"), help="search and replace")
    sp.add_argument("--regex", action="store_true", help="--replace's OLD is a regular expression")
    sp.add_argument("--strip", action="store_true", help="strip whitespace at both ends")
    sp.add_argument(
        "--normalize", action="store_true", help='join tags with ", ", drop empty tags and spaces'
    )
    sp.add_argument(
        "--apply", action="store_true", help="write the edit (after backing up every caption)"
    )
    sp.add_argument("--restore", metavar="BACKUP", help="put back a caption backup folder")
    sp.set_defaults(func=cmd_captions)

    sp = sub.add_parser("caption", help="caption images with a tagger or a model (dry run first)")
    with_config(sp)
    sp.add_argument("--captioner", required=True, help="wd14 (tags), blip or florence2 (sentences)")
    sp.add_argument("--model", help="hub id or local folder (default: the captioner's usual one)")
    sp.add_argument("--prefix", help="put this first in every caption, e.g. the trigger word")
    p_tag = {"type": float, "metavar": "P"}
    sp.add_argument("--threshold", dest="general_threshold", **p_tag, help="tagger: a tag's (0.35)")
    sp.add_argument("--character-threshold", **p_tag, help="tagger: a character tag's (0.85)")
    sp.add_argument("--max-tags", type=int, metavar="N", help="tagger: most tags per image")
    sp.add_argument("--exclude", dest="exclude_tags", type=lambda s: s.split(","), metavar="A,B")
    sp.add_argument("--overwrite", action="store_true", help="also replace existing captions")
    sp.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    sp.add_argument("--batch-size", type=int, help="images per forward pass")
    sp.add_argument("--max-new-tokens", type=int, metavar="N", help="captioner: longest caption")
    sp.add_argument("--task", help="florence2: its task prompt (default <DETAILED_CAPTION>)")
    sp.add_argument("--apply", action="store_true", help="write them (after a caption backup)")
    sp.set_defaults(func=cmd_caption)
