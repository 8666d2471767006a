#!/usr/bin/env bash
# Make Fashion-MNIST available offline: Debian's dataset-fashion-mnist package when apt and
# root are there; otherwise the trainer falls back to data.root and then torchvision's download.
set -euo pipefail
DEB_DIR=/usr/share/datasets/fashion-mnist
if [ -f "$DEB_DIR/train-images-idx3-ubyte.gz" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing Debian's dataset-fashion-mnist ..."
  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null)) &&
    exit 0
fi
echo "note: $DEB_DIR not found and apt unavailable; Fashion-MNIST will be downloaded by torchvision into data/ on first use" >&2
