# Shared by the GPU scripts (sourced, not run): an offline GPU box gets treespec from the tree and
# the wheels it lacks from a folder `prepare_wheels` filled on a machine with pip access, each
# wheel larger than one transfer split into parts that `install_wheels` joins and checks.

# check_torch PY DEVICE: exit with the fix when PY has no torch, or no CUDA device for DEVICE=cuda*
check_torch() {
    "$1" - "$2" <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(f"{sys.executable} has no torch: name the python that holds a CUDA build of torch (PYTHON=...)")
device = sys.argv[1]
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"DEVICE={device}: this python's torch {torch.__version__} sees no CUDA device; run on a GPU "
             "machine with a CUDA build of torch (PYTHON=...), or DEVICE=cpu for a smoke test")
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}")
PYEOF
}

# prepare_wheels PY DIR PART PACKAGE...: download the packages' wheels (no dependencies) into DIR,
# each over PART bytes split into DIR/<wheel>.partNN with its sha256 beside
prepare_wheels() {
    local py=$1 dir=$2 part=$3
    shift 3
    mkdir -p "$dir"
    "$py" -m pip download --quiet --no-deps -d "$dir" "$@"
    for whl in "$dir"/*.whl; do
        if [[ $(stat -c %s "$whl") -gt $part ]]; then
            split -b "$part" -d "$whl" "$whl.part"
            sha256sum "$whl" | awk '{print $1}' > "$whl.sha256"
            rm "$whl"
        fi
    done
    ls -l "$dir"
}

# install_wheels PY DIR: join every split wheel in DIR (refusing one whose parts are missing or
# damaged), then install all of DIR's wheels without an index
install_wheels() {
    local py=$1 dir=$2 first whl
    for first in "$dir"/*.whl.part00; do
        [[ -e "$first" ]] || continue
        whl=${first%.part00}
        cat "$whl".part* > "$whl"
        [[ "$(sha256sum "$whl" | awk '{print $1}')" == "$(cat "$whl.sha256")" ]] || {
            echo "error: $whl joined from its parts does not match $whl.sha256: a part is missing or damaged; copy the parts again" >&2
            rm -f "$whl"; return 1; }
    done
    compgen -G "$dir/*.whl" > /dev/null || { echo "error: no wheels in $dir" >&2; return 1; }
    "$py" -m pip install --quiet --no-index --no-deps "$dir"/*.whl
}
