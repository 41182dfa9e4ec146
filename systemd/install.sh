#!/bin/sh
# Install cosyedge as a system service: a venv under $PREFIX, the units, an example environment file.
# Usage: sudo [ORT_GPU=<onnxruntime-gpu wheel>] systemd/install.sh [--no-venv]      (PREFIX=/opt/cosyedge by default)
# Offline boxes: set PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels before running it.
set -eu
PREFIX="${PREFIX:-/opt/cosyedge}"
UNIT_DIR="${UNIT_DIR:-/etc/systemd/system}"
ETC_DIR="${ETC_DIR:-/etc/cosyedge}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"

if [ "${1:-}" != "--no-venv" ]; then
    python3 -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/pip" install --upgrade "$REPO"
    if [ -n "${ORT_GPU:-}" ]; then  # GPU runtime: onnxruntime-gpu (a Jetson wheel path) instead of onnxruntime
        "$PREFIX/venv/bin/pip" uninstall -y onnxruntime
        "$PREFIX/venv/bin/pip" install "$ORT_GPU"
    fi
fi
[ -x "$PREFIX/venv/bin/cosyedge" ] || { echo "install.sh: $PREFIX/venv/bin/cosyedge is missing" >&2; exit 1; }

install -m 0644 "$REPO/systemd/cosyedge.service" "$REPO/systemd/cosyedge@.service" \
    "$REPO/systemd/cosyedge-wyoming.service" "$UNIT_DIR/"
if [ "$PREFIX" != /opt/cosyedge ]; then
    sed -i "s#/opt/cosyedge/#$PREFIX/#g" "$UNIT_DIR/cosyedge.service" "$UNIT_DIR/cosyedge@.service" \
        "$UNIT_DIR/cosyedge-wyoming.service"
fi
install -d -m 0755 "$ETC_DIR"
install -m 0644 "$REPO/systemd/cosyedge.env.example" "$ETC_DIR/cosyedge.env.example"
[ -e "$ETC_DIR/cosyedge.env" ] || install -m 0644 "$REPO/systemd/cosyedge.env.example" "$ETC_DIR/cosyedge.env"

systemctl daemon-reload
echo "installed. Start one service:   systemctl enable --now cosyedge"
echo "          or one per GPU:       systemctl enable --now cosyedge@0 cosyedge@1"
echo "check:    curl -s http://127.0.0.1:8100/readyz ; journalctl -u cosyedge -f"
