"""`python -m convert SRC DST [...]` and `python -m convert --export DST OUT`."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading

from . import interrupt

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion never needs an accelerator

EPILOG = """\
Sharding: conversion writes a mesh-independent checkpoint, so there is no --mesh option here; parameters are
placed on a device mesh when loaded (kimi_jax.load_model(path, mesh="8x1"), python -m kimi_jax.serve --mesh 8x1).
Loading: kimi_jax.load_model(DST) or kimi_jax.load_model(SRC) (a Hugging Face directory is converted in memory).
MXFP4 experts stay packed in the checkpoint and in the loaded model (decoded inside the MoE kernels).
The default --dtype keep stores every tensor as it is in SRC, so --export gives back identical safetensors; --dtype
bf16 makes a smaller bfloat16 checkpoint (not lossless for float32 or FP8 sources)."""


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 5GB)")
    unit = (m.group(2) or "").upper().rstrip("B")
    mult = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
            "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}[unit]
    return int(float(m.group(1)) * mult)


def main(argv=None, command: bool = False) -> int:
    """The command line; returns the exit status (0, 2 for a refused or failed conversion, 130 / 143 when
    interrupted by Ctrl-C / SIGTERM, with nothing written). As the process's own command (`command=True`) the
    signals are ignored once the outcome is decided, so a late one cannot turn "written" into death by signal."""
    on_main = threading.current_thread() is threading.main_thread()
    # Installed before anything heavy is imported. SIGTERM cleans up as Ctrl-C does; both are also recorded, so one
    # whose exception Python swallowed (raised inside a GC callback) is raised again at the next tensor
    # (`convert.interrupt`).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    interrupt.clear()
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        if getattr(e, "committed", None):
            print(f"interrupted after {e.committed} was complete (it is the new checkpoint); what is left of the "
                  "replaced one is removed by the next run into it", file=sys.stderr)
        else:
            print("interrupted; nothing was written", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        interrupt.clear()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if command else signal.SIG_DFL if handler is None else handler)


def _main(argv) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert a Hugging Face safetensors checkpoint (Kimi K3 / K3.1, Kimi-Linear, DeepSeek-V3.2) "
                    "into a kimi_jax checkpoint (Orbax), or with --export write one back as safetensors.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs=2, metavar="PATH", help="SRC DST (convert) or DST OUT (with --export)")
    ap.add_argument("--export", action="store_true", help="export the kimi_jax checkpoint DST to safetensors in OUT")
    ap.add_argument("--dtype", choices=("bf16", "fp8", "keep"),
                    help="keep (default): every tensor as stored (lossless: --export gives the same safetensors back; "
                         "FP8 stays FP8); bf16: bfloat16 weights, FP8 dequantised; fp8: projection/expert weights as "
                         "FP8 e4m3 with 128x128 scales. MXFP4 experts stay packed in every mode")
    ap.add_argument("--architecture",
                    choices=("auto", "kimi_k3", "kimi_k31", "kimi_linear", "deepseek_v32"),
                    help="default: detected from config.json (an explicit value must agree with it)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    ap.add_argument("--part-size", type=_size,
                    help="approximate size of each Orbax part of the checkpoint (bounds memory; default 1GiB)")
    ap.add_argument("--shard-size", type=_size, help="--export: maximum safetensors shard size (default 5GiB)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    args = ap.parse_args(argv)
    # options of the other mode would be silently ignored (e.g. --export --dtype bf16 still exports source dtypes)
    other = ["--dtype", "--architecture", "--part-size"] if args.export else ["--shard-size"]
    given = [o for o in other if getattr(args, o[2:].replace("-", "_")) is not None]
    if given:
        ap.error(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                 f"{'only without --export' if args.export else 'only with --export'}")
    defaults = {"dtype": "keep", "architecture": "auto", "part_size": _size("1GiB"), "shard_size": _size("5GiB")}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    level = logging.WARNING if args.quiet else logging.INFO
    fmt = "%(asctime)s %(name)s %(levelname)s: %(message)s"
    logging.basicConfig(level=level, format=fmt)
    # absl (imported with Orbax) may have configured the root logger first, leaving it at WARNING: the package's
    # own progress lines get their own handler and level
    pkg = logging.getLogger("convert")
    if not any(getattr(h, "_kimi_jax_cli", False) for h in pkg.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt))
        handler._kimi_jax_cli = True
        pkg.addHandler(handler)
        pkg.propagate = False
    pkg.setLevel(level)
    if not any(isinstance(f, _UnretrievedReadFailures) for f in logging.getLogger("asyncio").filters):
        logging.getLogger("asyncio").addFilter(_UnretrievedReadFailures())
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from . import ConvertError, export
    # the command composes the layers: the target shapes come from the model, through its loader (convert itself
    # never imports the model)
    from kimi_jax.checkpoint import convert_checkpoint

    try:
        if args.export:
            export(args.paths[0], args.paths[1], overwrite=args.overwrite, shard_bytes=args.shard_size,
                   progress=not args.quiet)
        else:
            convert_checkpoint(args.paths[0], args.paths[1], dtype=args.dtype, architecture=args.architecture,
                               overwrite=args.overwrite, progress=not args.quiet, part_bytes=args.part_size)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system refused (destination not creatable, disk full, permissions): nothing kept
        print(f"error: {e}; nothing was written", file=sys.stderr)
        return 2
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the conversion is so that its temporary directory is removed on the way out."""


def _interrupt(signum, frame):
    exc = _Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    interrupt.request(exc)
    if not interrupt.deferring():  # else raised by the next `interrupt.check`, once the critical steps are done
        raise exc()


class _UnretrievedReadFailures(logging.Filter):
    """The other half of `_quiet_unraisable`: when several reads of a damaged part fail, Orbax raises the first and
    asyncio logs each of the others, at garbage collection, as "Task exception was never retrieved" with a
    traceback, around the one clear error line. Those records are dropped; every other asyncio record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Task exception was never retrieved")


def _quiet_unraisable(unraisable, default=sys.unraisablehook):
    """Orbax restores a part through asyncio; when one read fails (a damaged part) its event loop closes while
    TensorStore still completes the other reads, and each late callback would print an "Event loop is closed"
    traceback around the clear error message. Those are dropped; anything else is reported as usual."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    default(unraisable)


if __name__ == "__main__":
    sys.unraisablehook = _quiet_unraisable  # the command's own process only (late callbacks arrive after main)
    raise SystemExit(main(command=True))
