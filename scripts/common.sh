# Shared setup of scripts/demo.sh and scripts/test.sh; source it, do not run it.
#
# Provides:
#   RANDATTN_ROOT            repository root (absolute)
#   RANDATTN_BUILD_DIR       build directory (default: $RANDATTN_ROOT/build)
#   RANDATTN_PACKAGES        Debian packages the caller needs (the headers' own dependencies and
#                            the build tools; scripts append what else they use)
#   randattn_require_packages   check the Debian packages, install the missing ones if root
#   randattn_configure_and_build [cmake args...]   configure and build every enabled target

RANDATTN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RANDATTN_BUILD_DIR="${RANDATTN_BUILD_DIR:-$RANDATTN_ROOT/build}"

RANDATTN_PACKAGES=(libeigen3-dev librandom123-dev libcli11-dev cmake g++ make)

randattn_log() {
    printf 'randattn: %s\n' "$*" >&2
}

# Prints the packages from RANDATTN_PACKAGES that dpkg does not report as installed.
randattn_missing_packages() {
    local pkg status
    for pkg in "${RANDATTN_PACKAGES[@]}"; do
        status="$(dpkg -s "$pkg" 2>/dev/null || true)"
        if ! grep -q '^Status: install ok installed' <<<"$status"; then
            printf '%s\n' "$pkg"
        fi
    done
}

randattn_require_packages() {
    if ! command -v dpkg >/dev/null 2>&1; then
        randattn_log "dpkg not found: not a Debian system, assuming these are installed: ${RANDATTN_PACKAGES[*]}"
        return 0
    fi
    local missing
    mapfile -t missing < <(randattn_missing_packages)
    if [ "${#missing[@]}" -eq 0 ]; then
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        randattn_log "missing Debian packages: ${missing[*]}"
        randattn_log "install them with: sudo apt-get install -y --no-install-recommends ${missing[*]}"
        exit 1
    fi
    randattn_log "installing missing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
}

randattn_configure_and_build() {
    cmake -S "$RANDATTN_ROOT" -B "$RANDATTN_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@"
    cmake --build "$RANDATTN_BUILD_DIR" -j"$(nproc)"
}
