#!/bin/sh
# cosyedge installer, at the top of an unpacked appliance artefact (`cosyedge appliance build`, docs/deploy.md).
# Usage: ./install.sh [--prefix DIR] [--no-systemd]         (default prefix /opt/cosyedge; root for systemd)
#   ORT_GPU=<onnxruntime-gpu wheel file> ./install.sh       the GPU runtime instead of onnxruntime (Jetson: JetPack's)
# Offline: the venv comes from wheels/ with pip --no-index; nothing here reaches a network. Idempotent: a second
# run upgrades the venv in place and keeps the state directory, the current bundle and your environment file.
set -eu
die() { echo "install.sh: $*" >&2; exit 2; }
HERE="$(cd "$(dirname "$0")" && pwd)"
PREFIX=/opt/cosyedge
SYSTEMD=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#--prefix=}"; shift ;;
        --no-systemd) SYSTEMD=0; shift ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (usage: ./install.sh [--prefix DIR] [--no-systemd])" ;;
    esac
done

[ -f "$HERE/SHA256SUMS" ] && [ -f "$HERE/appliance.json" ] || die "run me at the top of an unpacked artefact"
(cd "$HERE" && sha256sum --quiet --strict -c SHA256SUMS) >/dev/null 2>&1 \
    || die "files do not match SHA256SUMS: the artefact is damaged or incomplete; copy it again"
field() { sed -n "s/^  \"$1\": \"\\([^\"]*\\)\".*/\\1/p" "$HERE/appliance.json"; }
PYVER="$(field python)"; WHEEL="$(field wheel)"; DEFAULT="$(field default_bundle)"; PLATFORM="$(field platform)"
[ "linux-$(uname -m)" = "$PLATFORM" ] || die "this artefact is for $PLATFORM, this machine is linux-$(uname -m)"
PY=""
for candidate in ${PYTHON:-} "python$PYVER" python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c \
        "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PYVER'.split('.'))))" 2>/dev/null; then
        PY="$candidate"; break
    fi
done
[ -n "$PY" ] || die "needs Python $PYVER (its wheels are built for it): install it, set PYTHON=, or build the \
artefact with --python for this box's version"
if [ "$SYSTEMD" = 1 ]; then
    [ -d /run/systemd/system ] || die "systemd is not running here: rerun with --no-systemd"
    [ "$(id -u)" = 0 ] || die "the systemd install needs root (or use --no-systemd --prefix DIR)"
    ETC_DIR="${ETC_DIR:-/etc/cosyedge}"
else
    ETC_DIR="$PREFIX/etc"
fi
mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"
VENV="$PREFIX/venv"
MARKER="$VENV/.cosyedge-appliance"  # this installer made the venv: only then is it upgraded, or replaced

# The venv: made without ensurepip (Debian ships it separately), pip itself comes from the wheelhouse. A venv (or
# anything) at PREFIX/venv that this installer did not make is a user's: nothing is installed into it nor removed.
# An install from before the marker is known by the appliance.json it copied into the prefix.
if [ -e "$VENV" ] || [ -L "$VENV" ]; then
    [ -f "$MARKER" ] || { [ -f "$PREFIX/appliance.json" ] && [ -x "$VENV/bin/python" ]; } \
        || die "$VENV exists and was not made by install.sh: nothing was changed; move it or give another --prefix"
fi
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c \
        "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PYVER'.split('.'))))" 2>/dev/null; then
    rm -rf "$VENV"  # made by an earlier run for another Python: it holds only installed packages
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv --without-pip "$VENV"
: > "$MARKER"
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$HERE/wheels" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
    PIP_CONFIG_FILE=/dev/null PIP_ROOT_USER_ACTION=ignore
PIP_WHEEL="$(ls "$HERE"/wheels/pip-*.whl)"
pip() { "$VENV/bin/python" "$PIP_WHEEL/pip" "$@"; }
GPU=""
[ -n "${ORT_GPU:-}" ] && { [ -f "$ORT_GPU" ] || die "ORT_GPU=$ORT_GPU is not a file"; GPU=1; }
pip show -q onnxruntime-gpu >/dev/null 2>&1 && GPU=1  # an upgrade keeps the GPU runtime installed before
set --
for wheel in "$HERE"/wheels/*.whl; do
    case "$(basename "$wheel")" in onnxruntime-*) [ -n "$GPU" ] && continue ;; esac
    set -- "$@" "$wheel"
done
pip install -q --no-deps "$@"  # the wheelhouse is the whole resolved set: nothing else to look for
pip install -q --no-deps --force-reinstall "$HERE/wheels/$WHEEL"  # same version, newer build: still replaced
if [ -n "${ORT_GPU:-}" ]; then
    pip uninstall -q -y onnxruntime >/dev/null 2>&1 || true
    pip install -q --no-deps --force-reinstall "$ORT_GPU"
fi

# Bundles: each checked (hashes) into the store; the first install makes the artefact's default current, an
# upgrade adds them and keeps the current one (`cosyedge bundle install` switches, `rollback` goes back).
for bundle in "$DEFAULT" $(ls "$HERE/bundles"); do
    "$VENV/bin/cosyedge" bundle install "$HERE/bundles/$bundle" --store "$PREFIX/bundles" --no-switch \
        --no-load-check >/dev/null
done

# Settings: appliance.env is this installer's (rewritten each run); cosyedge.env is yours (made once, kept).
{
    echo "# Written by install.sh on every run; your settings go in $ETC_DIR/cosyedge.env."
    echo "COSYEDGE_BUNDLE=$PREFIX/bundles/current"
    echo "COSYEDGE_BUNDLE_STORE=$PREFIX/bundles"
    [ "$SYSTEMD" = 1 ] || echo "COSYEDGE_HOME=$PREFIX/state"
} > "$PREFIX/appliance.env"
install -d -m 0755 "$ETC_DIR" "$PREFIX/bin"
install -m 0644 "$HERE/systemd/cosyedge.env.example" "$ETC_DIR/cosyedge.env.example"
[ -e "$ETC_DIR/cosyedge.env" ] || install -m 0644 "$HERE/systemd/cosyedge.env.example" "$ETC_DIR/cosyedge.env"
cat > "$PREFIX/bin/cosyedge" <<EOF
#!/bin/sh
# cosyedge with the appliance's settings (those of the service): $PREFIX/appliance.env, then $ETC_DIR/cosyedge.env.
set -a
. "$PREFIX/appliance.env"
[ -r "$ETC_DIR/cosyedge.env" ] && . "$ETC_DIR/cosyedge.env"
set +a
exec "$VENV/bin/cosyedge" "\$@"
EOF
chmod 0755 "$PREFIX/bin/cosyedge"
cp "$HERE/appliance.json" "$PREFIX/appliance.json"

if [ "$SYSTEMD" = 0 ]; then
    mkdir -p "$PREFIX/state"
    echo "installed $(field version) in $PREFIX (state: $PREFIX/state). Start the service:"
    echo "    $PREFIX/bin/cosyedge serve"
    exit 0
fi
UNIT_DIR="${UNIT_DIR:-/etc/systemd/system}"
for unit in cosyedge.service cosyedge@.service cosyedge-wyoming.service; do
    sed -e "s#/opt/cosyedge/#$PREFIX/#g" -e "s#/etc/cosyedge/#$ETC_DIR/#g" "$HERE/systemd/$unit" > "$UNIT_DIR/$unit"
    chmod 0644 "$UNIT_DIR/$unit"
done
systemctl daemon-reload
if systemctl -q is-enabled 'cosyedge@*' 2>/dev/null; then  # one service per GPU: restart those instead
    systemctl restart 'cosyedge@*'
else
    systemctl enable -q cosyedge
    systemctl restart cosyedge
fi
echo "installed $(field version) in $PREFIX; cosyedge is running (state: /var/lib/cosyedge)."
echo "check:    curl -s http://127.0.0.1:8100/readyz ; journalctl -u cosyedge -f"
