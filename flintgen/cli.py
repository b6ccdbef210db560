"""The ``flintgen`` command line.

Errors: a user error (bad spec field or file, unmapped model type, unsupported
shape, bad option or environment value) prints one ``flintgen: error:`` line
naming the value, what is supported and the fix, and exits 2; an internal
failure (a compile error, a bug) prints one line ending "rerun with --debug"
and exits 1. Tracebacks only with ``--debug`` or ``FLINTGEN_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings

import click

from flintgen import cache, toolchain
from flintgen._version import __version__
from flintgen.kernels import KERNELS, get_def
from flintgen.knobs import MAX_NUM_SMS, check_all, knobs
from flintgen.spec import MAX_TOKENS_LIMIT, SUPPORTED_KV_DTYPES, Spec

MAX_JOBS = 128
#: Exceptions that mean the user's input is wrong (exit 2); anything else is internal (exit 1).
USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)


def one_line(text: object) -> str:
    """A message as one line: its lines (bullets dropped) joined with '; '."""
    lines = (re.sub(r"^\s*-\s+", "", p).strip() for p in str(text).splitlines())
    return "; ".join(p for p in lines if p)


def _debug_requested(args) -> bool:
    if "--debug" in (sys.argv[1:] if args is None else list(args)):
        return True
    try:
        return knobs.debug
    except ValueError:
        return False  # reported when the command reads it


def _show_warning(message, category, filename, lineno, file=None, line=None):
    click.echo(f"flintgen: warning: {one_line(message)}", err=True)


class _Main(click.Group):
    """The group whose ``main`` turns exceptions into the one-line contract."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        debug = _debug_requested(args)
        try:
            check_all()
            with warnings.catch_warnings():
                if not debug:
                    warnings.showwarning = _show_warning
                    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch, harmless
                rv = super().main(args, prog_name or "flintgen", complete_var, standalone_mode=False, **extra)
        except SystemExit:
            raise
        except click.exceptions.Abort:
            click.echo("flintgen: aborted", err=True)
            sys.exit(1)
        except click.ClickException as e:
            if debug:
                raise
            hint = ""
            if isinstance(e, click.UsageError) and e.ctx is not None:
                hint = f" (see `{e.ctx.command_path} --help`)"
            click.echo(f"flintgen: error: {one_line(e.format_message())}{hint}", err=True)
            sys.exit(2)
        except USER_ERRORS as e:
            if debug:
                raise
            click.echo(f"flintgen: error: {one_line(e)}", err=True)
            sys.exit(2)
        except Exception as e:  # noqa: BLE001 - the one-line contract for internal failures
            if debug:
                raise
            click.echo(f"flintgen: internal error: {type(e).__name__}: {one_line(e)[:2000]} "
                       "(rerun with --debug for the traceback)", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _load_spec(preset: str | None, spec_file: str | None, hf_config: str | None = None,
               tp: int | None = None, page_size: int | None = None, weights: str | None = None,
               max_batch: int | None = None, kv_cache_dtype: str | None = None,
               max_tokens: int | None = None) -> Spec:
    from flintgen.hf import spec_from_hf_config
    from flintgen.presets import get_preset

    if sum(x is not None for x in (preset, spec_file, hf_config)) > 1:
        raise click.UsageError("give one of --preset, --spec and --hf-config, not several")
    if hf_config:
        spec = spec_from_hf_config(hf_config, tp_size=tp or 1, page_size=page_size or 16,
                                   weight_format=weights or "bf16", max_batch=max_batch or 256,
                                   name=os.path.basename(os.path.dirname(os.path.abspath(hf_config))),
                                   kv_cache_dtype=kv_cache_dtype or "bf16")
        return spec if max_tokens is None else spec.replace(max_tokens=max_tokens)
    spec = Spec.from_file(spec_file) if spec_file else get_preset(preset or "flint")
    changes = {k: v for k, v in (("tp_size", tp), ("page_size", page_size), ("weight_format", weights),
                                 ("max_batch", max_batch), ("kv_cache_dtype", kv_cache_dtype),
                                 ("max_tokens", max_tokens)) if v is not None}
    return spec.replace(**changes) if changes else spec


def _spec_options(f):
    f = click.option("--kv-cache-dtype", type=click.Choice(list(SUPPORTED_KV_DTYPES)), default=None,
                     help="Override the KV-cache element type (--hf-config default: bf16); fp8_e4m3 "
                          "stores K / V as e4m3 with one k_scale / v_scale per layer.")(f)
    f = click.option("--max-tokens", type=int, default=None,
                     help=f"Override max_tokens, the most tokens per fused QKV call (default 8; 1.."
                          f"{MAX_TOKENS_LIMIT}: one QKV binary per token tile of 8 / 16 / 32 / 64 up to it).")(f)
    f = click.option("--max-batch", type=int, default=None, help="Override max_batch (default 256).")(f)
    f = click.option("--weights", type=click.Choice(["bf16", "nvfp4"]), default=None,
                     help="Override the QKV weight format (--hf-config default: bf16).")(f)
    f = click.option("--page-size", type=int, default=None, help="Override the KV page size (default 16).")(f)
    f = click.option("--tp", type=int, default=None, help="Tensor-parallel size (per-rank heads).")(f)
    f = click.option("--hf-config", type=click.Path(exists=True, dir_okay=False),
                     help="A Hugging Face config.json to map to a spec.")(f)
    f = click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False),
                     help="Spec file (.toml or .json).")(f)
    f = click.option("--preset", default=None, help="Built-in spec name (`flintgen presets`).")(f)
    return f


def _spec_from_opts(o: dict, required: bool = False) -> Spec:
    if required and o["preset"] is None and o["spec_file"] is None and o["hf_config"] is None:
        from flintgen.presets import PRESETS

        raise click.UsageError("which model? pass --preset NAME (one of " + ", ".join(sorted(PRESETS)) +
                               "; `flintgen presets` lists them), --spec FILE.toml|.json or "
                               "--hf-config config.json")
    return _load_spec(o.pop("preset"), o.pop("spec_file"), o.pop("hf_config"), o.pop("tp"),
                      o.pop("page_size"), o.pop("weights"), o.pop("max_batch"), o.pop("kv_cache_dtype"),
                      o.pop("max_tokens"))


def _target_options(f):
    f = click.option("--num-sms", type=click.IntRange(1, MAX_NUM_SMS), default=None,
                     help="SM count. Default: the visible GPU's, else 132.")(f)
    return click.option("--arch", default=None,
                        help="Target arch (sm_90a). Default: the visible GPU's, else sm_90a.")(f)


_kernel_option = click.option("--kernel", "kernels", multiple=True,
                              help="Only these kernels (repeatable). Default: all.")


def _no_gpu_notice(arch, num_sms, doing: str) -> None:
    """Say so when the target is the CPU-machine default (sm_90a, 132 SMs)."""
    if arch is None and num_sms is None and toolchain.gpu_target() is None and knobs.arch is None:
        click.echo(f"no GPU visible: {doing} for sm_90a with 132 SMs (H100 SXM/H200); "
                   "use --arch/--num-sms to choose", err=True)


def _cache_root(cache_dir: str | None) -> str:
    return os.path.abspath(cache_dir or cache.default_root())


def _plan(spec: Spec, target, only=()) -> list[tuple[str, object]]:
    for name in only:
        get_def(name)  # unknown names fail early
    plan = []
    for name, kdef in KERNELS.items():
        if kdef.needed(spec) and (not only or name in only):
            plan += [(name, v) for v in kdef.variants(spec, target)]
    return plan


def _build_one(spec: Spec, kernel: str, variant, target, root: str):
    """Build (or find) one variant in the cache at ``root``; never falls back to an
    uncached build: ``flintgen build`` exists to fill the cache."""
    t0 = time.perf_counter()
    kdef = get_def(kernel)
    entry = cache.make_entry(variant, kdef.template_of(variant), dict(kdef.render_params(spec, variant)), target, root)
    outcome = cache.get_or_build(entry, fallback=False)
    meta = cache.read_meta(entry) or {}
    return variant.name, outcome.hit, time.perf_counter() - t0, meta.get("resources"), entry.dir


def _build_all(spec: Spec, plan, target, root: str, jobs: int):
    """(results, failures) of building ``plan``; failures are (variant name, exception)."""
    results, failures = [], []
    if jobs <= 1:
        with click.progressbar(plan, label="building", item_show_func=lambda p: p and p[1].name) as bar:
            for name, v in bar:
                try:
                    results.append(_build_one(spec, name, v, target, root))
                except Exception as e:  # noqa: BLE001 - reported below, build goes on
                    failures.append((v.name, e))
        return results, failures
    from flintgen import procutil

    with click.progressbar(length=len(plan), label="building") as bar:
        out = procutil.run_spawned(_build_one, [(spec, name, v, target, root) for name, v in plan], jobs,
                                   return_exceptions=True, on_done=lambda: bar.update(1))
    for (_, v), r in zip(plan, out):
        if isinstance(r, BaseException):
            failures.append((v.name, r))
        else:
            results.append(r)
    return results, failures


@click.group(cls=_Main)
@click.version_option(__version__, prog_name="flintgen")
@click.option("--debug", is_flag=True, help="Print Python tracebacks (also FLINTGEN_DEBUG=1).")
def main(debug):
    """flintgen: generate, compile and cache decode kernels for a model spec."""


@main.command()
@_spec_options
@_target_options
@click.option("--jobs", "-j", type=click.IntRange(1, MAX_JOBS), default=1, show_default=True,
              help="Parallel compile processes.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache root (default: FLINTGEN_CACHE_DIR, the checkout's cache/, or ~/.cache/flintgen).")
@_kernel_option
def build(arch, num_sms, jobs, cache_dir, kernels, **spec_opts):
    """Render and compile every kernel and launch variant the spec needs."""
    spec = _spec_from_opts(spec_opts, required=True)
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    root = _cache_root(cache_dir)
    plan = _plan(spec, target, kernels)
    cache.check_root_usable(root)
    _no_gpu_notice(arch, num_sms, "building")
    click.echo(f"flintgen {__version__}: spec {spec.name} ({spec.spec_hash}), target {target.arch} "
               f"x {target.num_sms} SMs, cache {root}: {len(plan)} kernels")
    t0 = time.perf_counter()
    results, failures = _build_all(spec, plan, target, root, jobs)
    hits = sum(1 for r in results if r[1])
    for name, hit, secs, res, _ in sorted(results):
        regs = (res or {}).get("registers")
        spill = (res or {}).get("spill_store_bytes")
        click.echo(f"  {'hit ' if hit else 'miss'} {name:<60} {secs:6.2f}s  regs={regs} spill={spill}")
    click.echo(f"{len(results)} built: {hits} hits, {len(results) - hits} misses, "
               f"{len(failures)} failed, {time.perf_counter() - t0:.1f}s")
    if failures:
        debug = _debug_requested(None)
        for name, e in failures:
            text = str(e) if debug else one_line(e)[:2000]
            click.echo(f"flintgen: error: building {name} failed: {type(e).__name__}: {text}", err=True)
        if not debug:
            click.echo("flintgen: error: rerun with --debug for the full compiler output", err=True)
        sys.exit(1)


@main.command(name="list")
@_spec_options
@_target_options
def list_(arch, num_sms, **spec_opts):
    """List the spec's kernels and their launch variants."""
    spec = _spec_from_opts(spec_opts)
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    for name, kdef in KERNELS.items():
        if not kdef.needed(spec):
            continue
        click.echo(f"{name}: {kdef.description}")
        for v in kdef.variants(spec, target):
            click.echo(f"    {v.name}")


@main.command()
@click.argument("kernel")
@_spec_options
@click.option("--variant", "variant_index", type=int, default=0, show_default=True,
              help="Index of the variant in `flintgen list`.")
@_target_options
def show(kernel, variant_index, arch, num_sms, **spec_opts):
    """Print the generated source of KERNEL for the spec."""
    from flintgen import codegen

    spec = _spec_from_opts(spec_opts)
    kdef = get_def(kernel)
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    variants = kdef.variants(spec, target)
    if not 0 <= variant_index < len(variants):
        raise click.BadParameter(f"{variant_index} is out of range: {kernel} has {len(variants)} variants")
    v = variants[variant_index]
    click.echo(codegen.render(v.kernel, kdef.template_of(v), dict(kdef.render_params(spec, v))), nl=False)


@main.command(name="show-spec")
@_spec_options
def show_spec(**spec_opts):
    """Print the spec's canonical JSON and hash."""
    spec = _spec_from_opts(spec_opts)
    click.echo(json.dumps(spec.to_dict(), indent=2, sort_keys=True))
    click.echo(f"spec_hash: {spec.spec_hash}")


@main.command()
def presets():
    """The built-in specs, one line each."""
    from flintgen.presets import PRESETS

    for name, p in sorted(PRESETS.items()):
        click.echo(f"{name:<14} hidden {p.hidden_size:<5} q/kv heads {p.num_q_heads}/{p.num_kv_heads:<3} "
                   f"head_dim {p.head_dim:<4} window {p.sliding_window or '-':<5} "
                   f"sinks {'yes' if p.sinks else 'no ':<3} qk_norm {'yes' if p.qk_norm else 'no ':<3} "
                   f"weights {p.weight_format:<6} layers {p.num_layers}")


@main.group(name="cache")
def cache_group():
    """Inspect and maintain the kernel cache."""


_cache_dir_option = click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                                 help="Cache root (default: `flintgen env` shows it).")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@cache_group.command()
@_cache_dir_option
def ls(cache_dir):
    """List cache entries, with sizes per target and in total."""
    root = _cache_root(cache_dir)
    entries = cache.list_entries(root)
    click.echo(f"cache root: {root} ({len(entries)} entries)")
    per_target: dict[str, list[int]] = {}
    for d, meta in entries:
        size = cache.tree_bytes(d)
        tdir = os.path.basename(os.path.dirname(d))
        acc = per_target.setdefault(tdir, [0, 0])
        acc[0] += 1
        acc[1] += size
        leftovers = len(cache.work_files(d))
        extra = f"  [{leftovers} leftover work files]" if leftovers else ""
        if meta is None:
            click.echo(f"  {os.path.relpath(d, root)}  {size // 1024} KiB  [incomplete]{extra}")
            continue
        click.echo(f"  {os.path.relpath(d, root)}  {size // 1024} KiB  built {meta.get('built_at')}  "
                   f"dsl {(meta.get('dsl') or {}).get('nvidia-cutlass-dsl')}{extra}")
    for tdir, (n, size) in sorted(per_target.items()):
        click.echo(f"target {tdir}: {n} entries, {_mib(size)}")
    click.echo(f"total: {len(entries)} entries, {_mib(sum(v[1] for v in per_target.values()))}")


@cache_group.command()
@_cache_dir_option
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--stale", is_flag=True,
              help="Remove only unusable entries (damaged, partial) and leftover work files.")
@click.option("--other-toolchains", is_flag=True,
              help="With --stale: also entries built by another DSL or flintgen version.")
def clean(cache_dir, yes, stale, other_toolchains):
    """Delete cache entries (all of them, or with --stale the unusable ones)."""
    root = _cache_root(cache_dir)
    if other_toolchains and not stale:
        raise click.UsageError("--other-toolchains only applies with --stale")
    if not yes and not stale:
        click.confirm(f"delete all entries under {root}?", abort=True)
    r = cache.clean(root, stale=stale, other_toolchains=other_toolchains)
    click.echo(f"removed {r.removed} entries and {r.work_removed} leftover work files "
               f"({_mib(r.bytes_freed)}) from {root}; kept {r.kept}")
    for d in r.busy:
        click.echo(f"flintgen: warning: {os.path.relpath(d, root)} is being built by another process: "
                   "skipped (run clean again when it finishes)", err=True)
    for path, why in r.failed:
        click.echo(f"flintgen: error: could not remove {path}: {why}", err=True)
    if r.failed:
        click.echo(f"flintgen: error: {len(r.failed)} entries could not be removed: check the permissions "
                   f"of {root}", err=True)
        sys.exit(1)


@cache_group.command()
@_cache_dir_option
@click.option("--no-load", is_flag=True, help="Check hashes only; do not load the libraries.")
def verify(cache_dir, no_load):
    """Check every entry with the runtime's check (key, place, file hashes, DSL
    version) and load it; exit 1 if any is bad."""
    root = _cache_root(cache_dir)
    bad = 0
    entries = cache.list_entries(root)
    for d, _ in entries:
        problem = cache.check_dir(d, load=not no_load)
        leftovers = cache.work_files(d)
        if problem or leftovers:
            bad += 1
            why = problem or f"{len(leftovers)} leftover work files of a killed build"
            click.echo(f"BAD {os.path.relpath(d, root)}: {why}")
    click.echo(f"{len(entries) - bad} ok, {bad} bad, in {root}"
               + ("; `flintgen cache clean --stale` removes the bad ones" if bad else ""))
    if bad:
        sys.exit(1)


@cache_group.command(name="pack")
@_spec_options
@_target_options
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache root to pack from (and build missing entries into).")
@_kernel_option
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Bundle file to write (.tar.gz; .tar.xz for xz).")
def cache_pack(arch, num_sms, cache_dir, kernels, output, **spec_opts):
    """Write one archive of exactly the entries the spec needs, building the
    missing ones (`flintgen build -j N` first to build in parallel)."""
    from flintgen import bundle

    spec = _spec_from_opts(spec_opts)
    _no_gpu_notice(arch, num_sms, "packing")
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    root = _cache_root(cache_dir)
    rep = bundle.pack(spec, target, output, root, kernels)
    click.echo(f"packed {rep.entries} entries ({rep.built} built first) of spec {spec.name} ({spec.spec_hash}) "
               f"for {target.arch} x {target.num_sms} SMs: {rep.members} members, {rep.bytes // 1024} KiB "
               f"uncompressed, {os.path.getsize(rep.path) // 1024} KiB -> {rep.path}")
    click.echo(f"sha256: {rep.sha256}")


@cache_group.command(name="unpack")
@click.argument("bundle_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--sha256", default=None, help="Refuse the file unless its sha256 is this (from `cache pack`).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Cache root to install into.")
@click.option("--load/--no-load", default=None,
              help="Load-check every library before installing it. Default: when apache-tvm-ffi and "
                   "libcute_dsl_runtime.so are available here; hashes and places are always checked.")
def cache_unpack(bundle_file, sha256, cache_dir, load):
    """Verify a bundle and install its entries into the cache root."""
    from flintgen import bundle

    root = _cache_root(cache_dir)
    rep = bundle.unpack(bundle_file, root, sha256, load=load)
    click.echo(f"bundle {rep.path} (sha256 {rep.sha256}, flintgen {rep.bundle_flintgen}, {rep.target.arch} x "
               f"{rep.target.num_sms} SMs): {len(rep.installed)} installed, {len(rep.skipped)} already present, "
               f"into {rep.root}")
    click.echo(f"libraries load-checked: {'yes' if rep.loaded else 'no' + (f' ({rep.load_note})' if rep.load_note else '')}")
    click.echo(f"flintgen {__version__} will use {rep.used} of the {rep.entries} entries")


@main.command()
def env():
    """Versions, target, cache root and tools."""
    import platform

    lines = {
        "flintgen": __version__,
        "python": platform.python_version(),
        "torch": toolchain.package_version("torch"),
        "nvidia-cutlass-dsl": dict(toolchain.dsl_versions()) or "not installed (serving only: cached kernels)",
        "dsl flavour": toolchain.dsl_flavour() if toolchain.dsl_installed() else None,
        "apache-tvm-ffi": toolchain.package_version("apache-tvm-ffi"),
        "runtime library": toolchain.find_runtime_lib() or "NOT FOUND",
        "linker (export)": toolchain.find_linker() or "NOT FOUND: install g++ to cache compiled kernels",
        "cache root": cache.default_root(),
    }
    try:
        gpu = toolchain.gpu_target()
        lines["gpu"] = f"{gpu.arch}, {gpu.num_sms} SMs" if gpu else "none visible"
    except ValueError as e:
        lines["gpu"] = f"unsupported: {e}"
    from flintgen.knobs import KNOBS

    for k, v in lines.items():
        click.echo(f"{k:>20}: {v}")
    for knob in KNOBS:
        click.echo(f"{knob.name:>28} = {os.environ.get(knob.name, '')!r}")


if __name__ == "__main__":
    main()
