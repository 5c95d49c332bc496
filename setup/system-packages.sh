#!/usr/bin/env bash
# The system packages some tests and tools need, installed by `make setup` where it can (Debian or
# Ubuntu, as root or with password-less sudo); elsewhere it prints the command and carries on, and
# the tests that need them skip, naming what is missing. Idempotent: nothing is installed twice.
#
#   intel-opencl-icd   ocloc, which compiles the Intel GPU path's kernels for real GPUs offline
#                      (tests/test_gpu_offline.py), and its dependency ocl-icd-libopencl1, the
#                      OpenCL ICD loader OpenVINO's GPU plugin links (libOpenCL.so.1, which reads
#                      OPENCL_LAYERS: the GPU emulation, tests/test_gpu_*plugin*.py)
#   chromium, chromium-driver   drive the server's chat page headless (tests/test_server_page.py)
#
# OV_KVCRUSH_SYSTEM_PACKAGES=0 skips this step (a machine whose packages are managed elsewhere).
set -uo pipefail

if [ "${OV_KVCRUSH_SYSTEM_PACKAGES:-1}" = 0 ]; then
    echo "system packages: skipped (OV_KVCRUSH_SYSTEM_PACKAGES=0)"
    exit 0
fi

need=()
command -v ocloc >/dev/null || need+=(intel-opencl-icd)
{ ldconfig -p 2>/dev/null | grep -q 'libOpenCL\.so\.1 '; } || need+=(ocl-icd-libopencl1)
command -v chromedriver >/dev/null || need+=(chromium chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
    echo "system packages: ocloc, the OpenCL ICD loader and chromedriver are installed"
    exit 0
fi

as_root=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        as_root=(none)
    fi
fi
if ! command -v apt-get >/dev/null || [ "${as_root[0]:-}" = none ]; then
    echo "system packages: missing ${need[*]}; install them as root (Debian/Ubuntu:" \
        "apt-get install ${need[*]}); until then the tests that need them skip, saying so"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
install() { "${as_root[@]}" apt-get install -y -q "$@" >/dev/null; }
if install "${need[@]}" || { "${as_root[@]}" apt-get update -q >/dev/null && install "${need[@]}"; }; then
    echo "system packages: installed ${need[*]}"
else
    echo "system packages: could not install ${need[*]}; the tests that need them skip, saying so"
fi
exit 0
