"""The ``flintgen`` command line."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time

import click

from flintgen import cache, toolchain
from flintgen._version import __version__
from flintgen.kernels import KERNELS, get_def
from flintgen.spec import Spec


def _load_spec(preset: str | None, spec_file: str | None, hf_config: str | None = None,
               tp: int | None = None, page_size: int | None = None, weights: str | None = None,
               max_batch: int | None = None) -> Spec:
    from flintgen.hf import spec_from_hf_config
    from flintgen.presets import get_preset

    if sum(x is not None for x in (preset, spec_file, hf_config)) > 1:
        raise click.UsageError("give one of --preset, --spec and --hf-config")
    if hf_config:
        return spec_from_hf_config(hf_config, tp_size=tp or 1, page_size=page_size or 16,
                                   weight_format=weights or "bf16", max_batch=max_batch or 256,
                                   name=os.path.basename(os.path.dirname(os.path.abspath(hf_config))))
    spec = Spec.from_file(spec_file) if spec_file else get_preset(preset or "flint")
    changes = {k: v for k, v in (("tp_size", tp), ("page_size", page_size), ("weight_format", weights),
                                 ("max_batch", max_batch)) if v is not None}
    return spec.replace(**changes) if changes else spec


def _spec_options(f):
    f = click.option("--max-batch", type=int, default=None, help="Override max_batch (default 256).")(f)
    f = click.option("--weights", type=click.Choice(["bf16", "nvfp4"]), default=None,
                     help="Override the QKV weight format (--hf-config default: bf16).")(f)
    f = click.option("--page-size", type=int, default=None, help="Override the KV page size (default 16).")(f)
    f = click.option("--tp", type=int, default=None, help="Tensor-parallel size (per-rank heads).")(f)
    f = click.option("--hf-config", type=click.Path(exists=True, dir_okay=False),
                     help="A Hugging Face config.json to map to a spec.")(f)
    f = click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False),
                     help="Spec file (.toml or .json).")(f)
    f = click.option("--preset", default=None, help="Built-in spec name (default: flint).")(f)
    return f


def _spec_from_opts(o: dict) -> Spec:
    return _load_spec(o.pop("preset"), o.pop("spec_file"), o.pop("hf_config"), o.pop("tp"),
                      o.pop("page_size"), o.pop("weights"), o.pop("max_batch"))


def _plan(spec: Spec, target, only=()) -> list[tuple[str, object]]:
    for name in only:
        get_def(name)  # unknown names fail early
    plan = []
    for name, kdef in KERNELS.items():
        if kdef.needed(spec) and (not only or name in only):
            plan += [(name, v) for v in kdef.variants(spec, target)]
    return plan


def _build_one(spec: Spec, kernel: str, variant, target, root: str):
    t0 = time.perf_counter()
    kdef = get_def(kernel)
    entry = cache.make_entry(variant, kdef.template, dict(kdef.render_params(spec, variant)), target, root)
    outcome = cache.get_or_build(entry)
    meta = cache.read_meta(entry) or {}
    return variant.name, outcome.hit, time.perf_counter() - t0, meta.get("resources"), entry.dir


@click.group()
@click.version_option(__version__, prog_name="flintgen")
def main():
    """flintgen: generate, compile and cache decode kernels for a model spec."""


@main.command()
@_spec_options
@click.option("--arch", default=None, help="Target arch (sm_90a). Default: the visible GPU's, else sm_90a.")
@click.option("--num-sms", type=int, default=None, help="SM count. Default: the visible GPU's, else 132.")
@click.option("--jobs", "-j", type=int, default=1, show_default=True, help="Parallel compile processes.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache root (default: FLINTGEN_CACHE_DIR, the checkout's cache/, or ~/.cache/flintgen).")
@click.option("--kernel", "kernels", multiple=True, help="Only these kernels (repeatable). Default: all.")
def build(arch, num_sms, jobs, cache_dir, kernels, **spec_opts):
    """Render and compile every kernel and launch variant the spec needs."""
    spec = _spec_from_opts(spec_opts)
    if arch is None and num_sms is None and toolchain.gpu_target() is None and not os.environ.get("FLINTGEN_ARCH"):
        click.echo("no GPU visible: building for sm_90a with 132 SMs (H100 SXM/H200); "
                   "use --arch/--num-sms to choose", err=True)
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    root = os.path.abspath(cache_dir) if cache_dir else cache.default_root()
    plan = _plan(spec, target, kernels)
    click.echo(f"flintgen {__version__}: spec {spec.name} ({spec.spec_hash}), target {target.arch} "
               f"x {target.num_sms} SMs, cache {root}: {len(plan)} kernels")
    t0 = time.perf_counter()
    results, failures = [], []
    if jobs <= 1:
        with click.progressbar(plan, label="building", item_show_func=lambda p: p and p[1].name) as bar:
            for name, v in bar:
                try:
                    results.append(_build_one(spec, name, v, target, root))
                except Exception as e:  # noqa: BLE001 - reported below, build goes on
                    failures.append((v.name, e))
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_build_one, spec, name, v, target, root): v for name, v in plan}
            with click.progressbar(length=len(futs), label="building") as bar:
                for fut in cf.as_completed(futs):
                    try:
                        results.append(fut.result())
                    except Exception as e:  # noqa: BLE001
                        failures.append((futs[fut].name, e))
                    bar.update(1)
    hits = sum(1 for r in results if r[1])
    for name, hit, secs, res, _ in sorted(results):
        regs = (res or {}).get("registers")
        spill = (res or {}).get("spill_store_bytes")
        click.echo(f"  {'hit ' if hit else 'miss'} {name:<60} {secs:6.2f}s  regs={regs} spill={spill}")
    click.echo(f"{len(results)} built: {hits} hits, {len(results) - hits} misses, "
               f"{len(failures)} failed, {time.perf_counter() - t0:.1f}s")
    for name, e in failures:
        click.echo(f"FAILED {name}: {e}", err=True)
    if failures:
        sys.exit(1)


@main.command(name="list")
@_spec_options
@click.option("--arch", default=None)
@click.option("--num-sms", type=int, default=None)
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
@click.option("--arch", default=None)
@click.option("--num-sms", type=int, default=None)
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
    click.echo(codegen.render(v.kernel, kdef.template, dict(kdef.render_params(spec, v))), nl=False)


@main.command(name="show-spec")
@_spec_options
def show_spec(**spec_opts):
    """Print the spec's canonical JSON and hash."""
    spec = _spec_from_opts(spec_opts)
    click.echo(json.dumps(spec.to_dict(), indent=2, sort_keys=True))
    click.echo(f"spec_hash: {spec.spec_hash}")


@main.group(name="cache")
def cache_group():
    """Inspect and maintain the kernel cache."""


@cache_group.command()
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
def ls(cache_dir):
    """List cache entries."""
    root = cache_dir or cache.default_root()
    entries = cache.list_entries(root)
    click.echo(f"cache root: {root} ({len(entries)} entries)")
    for d, meta in entries:
        if meta is None:
            click.echo(f"  {os.path.relpath(d, root)}  [incomplete]")
            continue
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                   if os.path.isfile(os.path.join(d, f)))
        click.echo(f"  {os.path.relpath(d, root)}  {size // 1024} KiB  built {meta.get('built_at')}  "
                   f"dsl {(meta.get('dsl') or {}).get('nvidia-cutlass-dsl')}")


@cache_group.command()
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clean(cache_dir, yes):
    """Delete every cache entry."""
    root = cache_dir or cache.default_root()
    if not yes:
        click.confirm(f"delete all entries under {root}?", abort=True)
    click.echo(f"removed {cache.clean(root)} entries from {root}")


@cache_group.command()
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None)
@click.option("--no-load", is_flag=True, help="Check hashes only; do not load the libraries.")
def verify(cache_dir, no_load):
    """Check every entry: complete, hash matches, current DSL, loads."""
    root = cache_dir or cache.default_root()
    bad = 0
    entries = cache.list_entries(root)
    for d, meta in entries:
        problem = cache.verify_dir(d, meta, load=not no_load)
        if problem:
            bad += 1
            click.echo(f"BAD {os.path.relpath(d, root)}: {problem}")
    click.echo(f"{len(entries) - bad} ok, {bad} bad, in {root}")
    if bad:
        sys.exit(1)


@cache_group.command(name="pack")
@_spec_options
@click.option("--arch", default=None, help="Target arch (sm_90a). Default: the visible GPU's, else sm_90a.")
@click.option("--num-sms", type=int, default=None, help="SM count. Default: the visible GPU's, else 132.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache root to pack from (and build missing entries into).")
@click.option("--kernel", "kernels", multiple=True, help="Only these kernels (repeatable). Default: all.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Bundle file to write (.tar.gz; .tar.xz for xz).")
def cache_pack(arch, num_sms, cache_dir, kernels, output, **spec_opts):
    """Write one archive of exactly the entries the spec needs, building the
    missing ones (`flintgen build -j N` first to build in parallel)."""
    from flintgen import bundle

    spec = _spec_from_opts(spec_opts)
    if arch is None and num_sms is None and toolchain.gpu_target() is None and not os.environ.get("FLINTGEN_ARCH"):
        click.echo("no GPU visible: packing for sm_90a with 132 SMs (H100 SXM/H200); "
                   "use --arch/--num-sms to choose", err=True)
    target = toolchain.resolve_target(arch, num_sms, cpu_default=True)
    root = os.path.abspath(cache_dir) if cache_dir else cache.default_root()
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

    root = os.path.abspath(cache_dir) if cache_dir else cache.default_root()
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
