# Source on the GPU machine after .device/setup.sh: a "serving" PYTHONPATH
# that has tvm-ffi and the DSL runtime library but not the CuTe DSL itself,
# as a machine staged with `stage.sh aot` has. Used to check that cached
# kernels load and run without cutlass.
mkdir -p /tmp/serve/nvidia_cutlass_dsl/cu13
ln -sfn /tmp/site/nvidia_cutlass_dsl/cu13/lib /tmp/serve/nvidia_cutlass_dsl/cu13/lib
for p in /tmp/site/*; do
    case "$(basename "$p")" in nvidia_cutlass_dsl*|cutlass*|cuda*|.staged*) ;; *) ln -sfn "$p" /tmp/serve/ ;; esac
done
export SERVE_PYTHONPATH="/tmp/serve:$(pwd)"
