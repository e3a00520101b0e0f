"""`kit ...`: the command line that scripts, CI and the notebooks share."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from kit import cli_data, cli_share
from kit.cli_data import config_of as _config
from kit.cli_data import print_json as _print_json
from kit.errors import KitError, explain
from kit.families import registry  # noqa: F401  (fills each family's default base first)


def cmd_env(args: argparse.Namespace) -> int:
    from kit.run.env import advice, report

    rep = report()
    if args.json:
        _print_json(rep)
        return 0
    for k, v in rep["versions"].items():
        print(f"{k:>14}  {v}")
    for d in rep["devices"]:
        print(f"{'device':>14}  {d}")
    print(f"{'disk free':>14}  {rep['disk_free_gib']} GiB")
    mem = rep.get("memory", {})
    print(
        f"{'host RAM':>14}  {mem.get('total_gib')} GiB total, {mem.get('available_gib')} GiB "
        f"available; this process peaked at {mem.get('peak_rss_gib')} GiB"
    )
    for note in advice(rep):
        print(f"  - {note}")
    return 0


def cmd_families(args: argparse.Namespace) -> int:
    from kit.families import family_class, family_names
    from kit.families.shipped import ARCHITECTURES

    rows = []
    for name in family_names():
        cls = family_class(name)
        shipped = [a for a in ARCHITECTURES.values() if a.family == name]
        rows.append(
            {
                "family": name,
                "variants": list(cls.variants),
                "video": cls.video,
                "audio": cls.audio,
                "native_resolution": cls.native_resolution,
                "base_model": cls.hub_id,
                "shipped_configs": {a.folder: a.title for a in shipped},
            }
        )
    if args.json:
        _print_json(rows)
        return 0
    for r in rows:
        kinds = f" ({', '.join(r['variants'])})" if r["variants"] else ""
        print(
            f"{r['family']}{kinds}: {r['base_model']}, {r['native_resolution']} px"
            + (", video" if r["video"] else "")
            + (" with sound" if r["audio"] else "")
        )
        for folder, title in r["shipped_configs"].items():
            print(f"  shipped config {folder}: {title}")
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    import inspect

    from kit.families import get_family

    family = get_family(args.family)
    extra = {}
    if args.variant:
        # Only a family whose tiny copy comes in several layouts takes one (Wan: 2.1, 2.2 A14B's
        # two experts, TI2V-5B).
        if "variant" not in inspect.signature(family.make_tiny).parameters:
            raise KitError(f"--variant: {args.family} writes one tiny layout; leave it out")
        extra["variant"] = args.variant
    path = family.make_tiny(args.out_dir, seed=args.seed, **extra)
    kind = f"{args.family} ({args.variant})" if args.variant else args.family
    print(f"wrote a tiny random-init {kind} model to {path}")
    return 0


def cmd_buckets(args: argparse.Namespace) -> int:
    from kit.data.report import bucket_report, report_lines

    if args.processes < 1:
        raise KitError(f"--processes {args.processes} must be at least 1")
    rep = bucket_report(_config(args), args.processes)
    if args.json:
        _print_json(rep)
        return 0
    print("\n".join(report_lines(rep)))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from kit.preflight.advice import advise
    from kit.preflight.estimate import GIB, GPUS, estimate

    cfg = _config(args)
    est = estimate(cfg, processes=args.processes, layout=args.layout)
    d = est.to_dict()
    budget = args.budget
    if args.gpu:
        if args.gpu not in GPUS:
            raise KitError(f"unknown --gpu '{args.gpu}' (known: {', '.join(GPUS)})")
        d["gpu"] = args.gpu
        d["fits_gpu"] = est.fits(GPUS[args.gpu])
        budget = GPUS[args.gpu] if budget is None else budget
    if budget is not None:
        d["budget_gib"] = budget
        d["fits_budget"] = est.fits(budget)
        rows = advise(cfg, budget, card=args.gpu) if not est.fits(budget) or args.advise else []
        d["advice"] = [{k: v for k, v in r.items() if k != "estimate"} for r in rows]
    if args.json:
        _print_json(d)
        return 0
    for k, v in est.components.items():
        print(f"{k:>24}  {v / GIB:8.3f} GiB")
    phase = d["details"]["peak_phase"]
    print(f"{'total':>24}  {est.total_bytes / GIB:8.3f} GiB  (peak in the {phase})")
    print(f"{'setup (cache filling)':>24}  {est.setup_bytes / GIB:8.3f} GiB")
    for k, v in est.host.items():
        if v:
            print(f"{'host RAM: ' + k:>24}  {v / GIB:8.3f} GiB")
    print(f"{'host RAM total':>24}  {est.host_bytes / GIB:8.3f} GiB")
    for name, ok in d["fits"].items():
        print(f"{name:>24}  {'fits' if ok else 'does not fit'}")
    if budget is not None:
        print(f"{'budget':>24}  {budget} GiB: {'fits' if d['fits_budget'] else 'does not fit'}")
        for r in d.get("advice", []):
            if "launch" in r:  # no setting fits one card: the fewest GPUs that hold the run
                print(f"  - {r['launch']['summary']}, {r['changes']}: {r['launch']['command']}")
                continue
            print(
                f"  - {r['changes']}: {r['peak_gib']} GiB (host RAM {r['host_ram_gib']} GiB), "
                f"about {r['slowdown']}x the time"
            )
        if not d["fits_budget"] and not d.get("advice"):
            print("  - no searched setting fits this budget")
    for note in est.notes:
        print(f"  note: {note}")
    return 0


def cmd_network(args: argparse.Namespace) -> int:
    from kit.methods import preview
    from kit.train.sizes import refuse_impossible_rank

    cfg = _config(args)
    refuse_impossible_rank(cfg)  # the network's weights are made for real: a rank too large
    summary = preview(cfg)
    if args.json:
        _print_json(
            {
                "kind": summary.kind,
                "trainable": summary.trainable,
                "total": summary.total,
                "modules": summary.rows(),
            }
        )
        return 0
    for row in summary.rows():
        print(f"{row['trainable']:>10,}  {row['module']}")
    share = summary.trainable / max(1, summary.total)
    print(
        f"{summary.kind}: {len(summary.modules)} modules, {summary.trainable:,} trainable parameters ({share:.2%})"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from kit.train.loop import train

    result = train(_config(args), resume=args.resume, force=args.force, overwrite=args.overwrite)
    print(
        f"{'stopped' if result.interrupted else 'finished'} at step {result.step}; run folder: {result.run_dir}"
    )
    return 130 if result.interrupted else 0


def cmd_notebooks(args: argparse.Namespace) -> int:
    from kit.ui.notebooks import run_notebooks

    params = {name: _literal(value) for name, value in args.param or []}
    run_notebooks(args.out_dir, params, only=args.only)  # one line per notebook as it ends
    report = Path(params.get("output_dir") or Path(args.out_dir) / "run") / "learning_report.json"
    if report.is_file():
        _print_learning(json.loads(report.read_text()), report)
    return 0


def _print_learning(report: dict, path: Path) -> None:
    from kit.toy.learning import format_table

    s = report["summary"]
    drop = s["unrelated_drop_points"]
    change = (
        f"{drop:.1f} points lower" if drop > 0 else f"{-drop:.1f} points higher" if drop else "same"
    )
    print(f"\nWhat the fine-tune learned ({report['seeds']} images per group and adapter; {path}):")
    print(format_table(report))
    print(
        f"concept on trigger prompts: {s['concept_rate_before']:.0%} before, "
        f"{s['concept_rate_after']:.0%} after; unrelated prompts (color and shape): "
        f"{s['unrelated_accuracy_before']:.0%} before, {s['unrelated_accuracy_after']:.0%} after "
        f"({change})"
    )
    d = report.get("drift")
    if d:
        print(
            f"drift of unrelated prompts ({d['n']} prompts, each against the base's image for "
            f"the same seed): median color distance {d['color_drift']} RGB units, shape agreement "
            f"{d['shape_agreement']:.0%}, position agreement {d['position_agreement']:.0%}; "
            f"color off the named one {d['color_error_before']} before, "
            f"{d['color_error_after']} after"
        )
        if d.get("concept_color_distance") is not None:
            print(
                f"learned color: {d['concept_color_distance']} RGB units from the data's "
                f"(concept on trigger prompts {d['concept_rate_after']:.0%})"
                + (
                    f"; the base's VAE alone brings the data's color back "
                    f"{d['concept_color_floor']} units off"
                    if d.get("concept_color_floor") is not None
                    else ""
                )
            )
    for name, why in report.get("skipped", {}).items():
        print(f"{name}: not drawn ({why})")


def cmd_learning(args: argparse.Namespace) -> int:
    from kit.toy.learning import learning_report

    path = Path(args.run_dir) / "learning_report.json"
    if args.show:
        if not path.is_file():
            raise KitError(f"{path} not found; run `kit learning {args.run_dir}` first")
        report = json.loads(path.read_text())
    else:
        report = learning_report(
            args.run_dir,
            seeds=args.seeds,
            checkpoint=args.checkpoint,
            per_group=args.prompts,
            drift_seeds=args.drift_prompts,
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_learning(report, path)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kit.preflight.plan import plan

    base = _config(args) if args.config else None
    p = plan(
        args.data_dir,
        args.task,
        base=base,
        family=args.family,
        pretrained_model=args.pretrained_model,
        gpu=args.gpu,
        budget_gib=args.budget,
        trigger=args.trigger,
        output_dir=args.output_dir,
    )
    if not args.out:
        _print_json(p.to_dict())
        return 0
    p.save(args.out)
    for line in p.reasons():
        print(f"- {line}")
    if p.launch:  # one card cannot hold the run: the multi-GPU launch planned
        command = p.launch["command"].replace("CONFIG", str(args.out))
        print(f"wrote {args.out}; launch it on {p.launch['processes']} GPUs: {command}")
        return 0
    print(f"wrote {args.out}; train it with: kit train {args.out}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from kit.report.doctor import SEVERITIES, diagnose, format_findings, write_report
    from kit.run.folder import open_run

    run = open_run(args.run_dir)
    if not (run.manifest.is_file() or run.metrics.is_file() or run.checkpoints.is_dir()):
        raise KitError(
            f"not a run folder: {args.run_dir} has a {run.config.name} but nothing a run writes "
            f"({run.manifest.name}, logs, checkpoints); give the folder `kit train` wrote"
        )
    findings = diagnose(run.root)
    write_report(run.root)
    if args.json:
        _print_json([f.to_dict() for f in findings])
    else:
        print(format_findings(findings))
    worst = min((SEVERITIES.index(f.severity) for f in findings), default=len(SEVERITIES))
    return 1 if args.fail_on and worst <= SEVERITIES.index(args.fail_on) else 0


def cmd_accelerate_config(args: argparse.Namespace) -> int:
    from kit.train.distributed import write_accelerate_config

    cfg = _config(args) if args.config else None
    out = write_accelerate_config(
        args.out,
        cfg,
        processes=args.processes,
        deepspeed_stage=args.deepspeed_stage,
        offload_optimizer=args.offload_optimizer,
        mixed_precision=args.mixed_precision,
        fsdp=args.fsdp,
        fsdp_version=args.fsdp_version,
        fsdp_offload=args.fsdp_offload,
        machines=args.machines,
        machine_rank=args.machine_rank,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
    )
    print(f"wrote {out}; train with: accelerate launch --config_file {out} -m kit train CONFIG")
    if args.machines > 1:
        print(
            f"on each of the {args.machines} machines: the same command, with that machine's "
            "own file (written with its --machine-rank)"
        )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kit.report.archive import compare, format_comparison, plot_comparison

    result = compare(args.run_a, args.run_b)
    if args.plot:
        plot_comparison(result, args.plot)
    if args.json:
        _print_json({k: v for k, v in result.items() if k != "history"})
    else:
        print(format_comparison(result))
        if args.plot:
            print(f"loss curves: {args.plot}")
    return 0


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(
        prog="kit", description="Fine-tune diffusion models on your own images."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="config file (JSON or YAML)")
        sp.add_argument(
            "-s", "--set", action="append", metavar="KEY=VALUE", help="override a config field"
        )

    sp = sub.add_parser("env", help="check this machine: versions, devices, precision, disk")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_env)

    sp = sub.add_parser(
        "families", help="list the model families, their variants and shipped configs"
    )
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(func=cmd_families)

    sp = sub.add_parser("tiny", help="write a tiny random-init model of a family (offline)")
    sp.add_argument("family")
    sp.add_argument("out_dir")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument(
        "--variant", default="", help="a layout of the family (`kit families` lists them)"
    )
    sp.set_defaults(func=cmd_tiny)

    cli_data.add_commands(sub, with_config)

    sp = sub.add_parser(
        "buckets", help="show the buckets, dropped images and steps per epoch training will use"
    )
    with_config(sp)
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--processes", type=int, default=1, help="training processes (GPUs) sharing each epoch"
    )
    sp.set_defaults(func=cmd_buckets)

    sp = sub.add_parser(
        "estimate", help="estimate the VRAM a config needs (no weights, no GPU), with advice"
    )
    with_config(sp)
    sp.add_argument("--gpu", help="a card name from the table, e.g. 'RTX 3060 12GB'")
    sp.add_argument("--budget", type=float, help="memory budget in GiB")
    sp.add_argument(
        "--advise", action="store_true", help="show the best settings even when the config fits"
    )
    sp.add_argument(
        "--processes", type=int, default=1, help="GPUs the run is split over (memory per GPU)"
    )
    sp.add_argument(
        "--layout",
        default="ddp",
        help="how several processes split the run: ddp, zero1, zero2 or fsdp (default ddp)",
    )
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_estimate)

    sp = sub.add_parser("network", help="list the modules the network adapts, before training")
    with_config(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_network)

    sp = sub.add_parser("train", help="train from a config")
    with_config(sp)
    sp.add_argument("--resume", metavar="latest|PATH", help="continue from a checkpoint")
    sp.add_argument(
        "--force", action="store_true", help="resume even if settings or captions changed"
    )
    sp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in output_dir (the files it wrote; yours stay)",
    )
    sp.set_defaults(func=cmd_train)

    cli_share.add_commands(sub)

    sp = sub.add_parser("plan", help="propose a config from the dataset and the task, with reasons")
    sp.add_argument(
        "data_dir",
        nargs="?",
        default="",
        help="folder of images and captions (none: --config's datasets)",
    )
    sp.add_argument("--task", required=True, choices=["character", "style", "concept"])
    sp.add_argument("--family", help="model family (default: the config's, else sd15)")
    sp.add_argument("--gpu", help="a card name from the estimator's table, to fit the batch to")
    sp.add_argument("--budget", type=float, help="memory budget in GiB instead of --gpu")
    sp.add_argument("--pretrained-model", help="base model folder or hub id")
    sp.add_argument("--trigger", help="trigger word (default: guessed from the captions)")
    sp.add_argument("--output-dir", help="run folder of the planned config")
    sp.add_argument("--config", help="a config whose other settings the plan keeps")
    sp.add_argument(
        "-s", "--set", action="append", metavar="KEY=VALUE", help="override a --config field"
    )
    sp.add_argument("--out", help="write the config here (default: print it as JSON)")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("doctor", help="diagnose a run: findings, evidence and fixes")
    sp.add_argument("run_dir")
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--fail-on", choices=["error", "warning", "info"], help="exit 1 on a finding this serious"
    )
    sp.set_defaults(func=cmd_doctor)

    sp = sub.add_parser("compare", help="compare two runs: config, dataset and loss")
    sp.add_argument("run_a", help="run folder A")
    sp.add_argument("run_b", help="run folder B (differences are shown as A → B)")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--plot", metavar="OUT.png", help="write both loss curves side by side")
    sp.set_defaults(func=cmd_compare)

    sp = sub.add_parser(
        "accelerate-config", help="write an accelerate config file (DDP, DeepSpeed ZeRO or FSDP)"
    )
    sp.add_argument("config", nargs="?", help="kit config: its accumulation and clipping are used")
    sp.add_argument(
        "--processes", type=int, default=1, help="processes (GPUs), all machines together"
    )
    sp.add_argument("--deepspeed-stage", type=int, help="DeepSpeed ZeRO stage (1 or 2)")
    sp.add_argument(
        "--fsdp", action="store_true", help="shard the trained weights too (FSDP; for ZeRO-3's use)"
    )
    sp.add_argument("--fsdp-version", type=int, default=2, help="FSDP version (2)")
    sp.add_argument(
        "--fsdp-offload", action="store_true", help="FSDP: parameter shards in CPU memory"
    )
    sp.add_argument("--machines", type=int, default=1, help="machines (nodes) in the launch")
    sp.add_argument("--machine-rank", type=int, default=0, help="this machine's rank (0 first)")
    sp.add_argument("--main-process-ip", help="address of machine 0 (several machines)")
    sp.add_argument("--main-process-port", type=int, help="its port (default 29500)")
    sp.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer state in CPU memory"
    )
    sp.add_argument("--mixed-precision", help="no, fp16 or bf16; default: the kit config's")
    sp.add_argument("--out", required=True, metavar="OUT.yaml")
    sp.set_defaults(func=cmd_accelerate_config)

    sp = sub.add_parser(
        "learning", help="what a toy-world fine-tune learned: three prompt groups, judged"
    )
    sp.add_argument("run_dir")
    sp.add_argument("--seeds", type=int, default=32, help="images per group and adapter scale")
    sp.add_argument("--prompts", type=int, default=8, help="prompts per group")
    sp.add_argument(
        "--drift-prompts", type=int, default=32, help="prompts per group of the drift measures"
    )
    sp.add_argument("--checkpoint", help="a checkpoint folder (default: the latest)")
    sp.add_argument("--show", action="store_true", help="print the saved report, draw nothing")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_learning)

    sp = sub.add_parser("notebooks", help="execute the seven notebooks headlessly (papermill)")
    sp.add_argument("out_dir")
    sp.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"))
    sp.add_argument("--only", nargs="+", help="notebook name prefixes, e.g. 00 04")
    sp.set_defaults(func=cmd_notebooks)
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kit` command.

    A failure is one line on stderr: a KitError as it is worded, a known library failure (a
    full disk, a file that is not UTF-8) explained, any other named by its type and first
    line. `--debug` (anywhere on the line) or `KIT_DEBUG=1` shows the full traceback; a
    command working in a run folder also appends it to the run's `logs/error.log`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("KIT_DEBUG", "") not in ("", "0")
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    from kit.logs import quiet_libraries

    quiet_libraries()
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except KitError as e:
            if debug:
                traceback.print_exc()
            print(f"kit: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kit: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            if debug:
                raise
            line = explain(e)
            if line:
                print(f"kit: error: {line}", file=sys.stderr)
                return 2
            first = (str(e).strip().splitlines() or [""])[0][:300]
            print(
                f"kit: error: unexpected {type(e).__name__}: {first} (the full traceback: run "
                "again with --debug or KIT_DEBUG=1; a run's own is in its logs/error.log)",
                file=sys.stderr,
            )
            return 1


def run() -> None:
    """The `kit` program: `main`, then exit without the interpreter's last garbage collection.

    A run leaves many objects in reference cycles (models, hooks, plots); collecting them at
    exit took about a second, after everything was written and closed. Frozen, they are freed
    with the process instead. Only here: `main` called in a long-lived process (a notebook, a
    test) leaves its garbage to the collector as usual."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
