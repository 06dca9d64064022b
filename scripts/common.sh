# Shared setup of scripts/demo.sh and scripts/test.sh; source it, do not run it.
#
# Provides:
#   RANDATTN_ROOT            repository root (absolute)
#   RANDATTN_BUILD_DIR       build directory (default: $RANDATTN_ROOT/build)
#   RANDATTN_PACKAGES        Debian packages the caller needs (the headers' own dependencies and
#                            the build tools; scripts append what else they use)
#   randattn_require_packages   check the Debian packages, install the missing ones if root
#   randattn_configure_and_build [cmake args...]   configure and build every enabled target
#   RANDATTN_LAUNCHER        cmake arguments that put ccache in front of the compiler, when
#                            ccache is installed (set RANDATTN_CCACHE=0 to build without it)
#   randattn_generator DIR   cmake arguments choosing Ninja for a new build directory DIR

RANDATTN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RANDATTN_BUILD_DIR="${RANDATTN_BUILD_DIR:-$RANDATTN_ROOT/build}"

RANDATTN_PACKAGES=(libeigen3-dev librandom123-dev libcli11-dev cmake g++ make ninja-build)

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

# A compiler cache makes a rebuild of an unchanged tree, on the same machine, nearly free, also
# from another clone: paths under the repository are hashed relative to it (base_dir), and the
# build directory's own path is left out of the hash (hash_dir), so every clone shares objects.
randattn_use_ccache() {
    RANDATTN_LAUNCHER=()
    if [ "${RANDATTN_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
        export CCACHE_BASEDIR="$RANDATTN_ROOT" CCACHE_NOHASHDIR=true
        export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-10G}"
        RANDATTN_LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    fi
}

# Ninja for a build directory not configured yet (one keeps its generator): it compiles a
# target's sources while the targets it links are still being built, where Make waits for them,
# so both cores stay busy beside the long translation unit of the registry's method table.
randattn_generator() {  # <build dir>
    RANDATTN_GENERATOR=()
    if command -v ninja >/dev/null 2>&1 && [ ! -e "$1/CMakeCache.txt" ]; then
        RANDATTN_GENERATOR=(-G Ninja)
    fi
}

randattn_configure_and_build() {
    randattn_use_ccache
    randattn_generator "$RANDATTN_BUILD_DIR"
    cmake -S "$RANDATTN_ROOT" -B "$RANDATTN_BUILD_DIR" "${RANDATTN_GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
        "${RANDATTN_LAUNCHER[@]}" "$@"
    cmake --build "$RANDATTN_BUILD_DIR" -j"$(nproc)"
}
