#!/usr/bin/env bash
# Builds the agent's container image, aether/agent:<version>, from the Containerfile with
# Debian's buildah: no daemon, vfs storage, chroot isolation, as root. The version is the
# workspace's (Cargo.toml), which must be the chart's appVersion, its default image tag.
#
#   1. cargo build --release --workspace --bins (seconds when already built), and the
#      CNI plugin as it ships, statically linked (scripts/build-cni-plugin.sh says why)
#   2. stages target/image/context/rootfs: the binaries the image carries (AETHER_IMAGE_BINS), without
#      their debug sections (objcopy --strip-debug), and the shared libraries `ldd` lists
#      for them, at the paths the loader looks in (none for the static plugin)
#   3. buildah build, then buildah push to an OCI archive,
#      target/image/aether-agent-<version>.oci.tar, which any registry tool can push
#      (e.g. `skopeo copy oci-archive:<file> docker://<registry>/aether/agent:<version>`)
#
# buildah's storage is the project's own, under target/image/storage, so a machine's other
# images are never touched. Installs buildah (apt-get) when it is missing. Prints the image
# size and the build times; the last line is "image: aether/agent:<version> ...".
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$AETHER_ROOT"
img_dir="$AETHER_IMAGE_DIR"
BINS=("${AETHER_IMAGE_BINS[@]}")

if [[ $(id -u) -ne 0 ]]; then
  echo "build-image: needs root (buildah's vfs storage and chroot isolation, without subuids)" >&2
  exit 1
fi
if ! command -v buildah >/dev/null; then
  command -v apt-get >/dev/null || { echo "build-image: buildah is missing and there is no apt-get to install it" >&2; exit 1; }
  echo "build-image: apt-get install buildah" >&2
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah >&2
fi
bah() { buildah --root "$img_dir/storage" --runroot "$img_dir/runroot" --storage-driver vfs "$@"; }
export BUILDAH_ISOLATION=chroot

# One version everywhere: the workspace's, the chart's appVersion, and the chart's default
# image (repository aether/agent, tag empty = appVersion, or the same version).
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' "$root/Cargo.toml")"
app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$root/charts/aether-agent/Chart.yaml")"
read -r repository tag < <(awk '
  /^image:/ { inside = 1; next }
  /^[^ #]/ { inside = 0 }
  inside && $1 == "repository:" { repo = $2 }
  inside && $1 == "tag:" { tag = $2; gsub(/"/, "", tag) }
  END { print repo, (tag == "" ? "-" : tag) }' "$root/charts/aether-agent/values.yaml")
[[ -n "$version" ]] || { echo "build-image: no version in [workspace.package] of $root/Cargo.toml" >&2; exit 1; }
if [[ "$app_version" != "$version" ]]; then
  echo "build-image: charts/aether-agent/Chart.yaml appVersion is '$app_version', the workspace version (Cargo.toml) is '$version'" >&2
  exit 1
fi
if [[ "$repository" != aether/agent || ( "$tag" != - && "$tag" != "$version" ) ]]; then
  echo "build-image: charts/aether-agent/values.yaml image is '$repository:$tag'; its default must be aether/agent with tag \"\" or \"$version\"" >&2
  exit 1
fi
image="aether/agent:$version"
archive="$img_dir/aether-agent-$version.oci.tar"

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

t0="$(now)"
aether_build_release
"$root/scripts/build-cni-plugin.sh" >/dev/null
t1="$(now)"

# The build context: rootfs/ is copied into the image as it is.
context="$img_dir/context"
rm -rf "$context"
mkdir -p "$context/rootfs/usr/local/bin"
libs=()
for b in "${BINS[@]}"; do
  bin="$(image_bin_source "$b")"
  [[ -x "$bin" ]] || { echo "build-image: $bin is missing after the build" >&2; exit 1; }
  # Without the DWARF line tables of the release profile (Containerfile says why).
  objcopy --strip-debug "$bin" "$context/rootfs/usr/local/bin/$b"
  chmod 0755 "$context/rootfs/usr/local/bin/$b"
  # ldd's lines: "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and the loader's
  # "/lib64/ld-linux-x86-64.so.2 (0x...)"; linux-vdso is the kernel's, with no file.
  if ldd "$bin" | grep -q "not found"; then
    ldd "$bin" >&2; echo "build-image: $bin needs a library this machine does not have" >&2; exit 1
  fi
  while read -r lib; do libs+=("$lib"); done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
done
mapfile -t libs < <(printf '%s\n' "${libs[@]}" | sort -u)
for lib in "${libs[@]}"; do
  # The file itself (cp -L), at the path the loader was found to use.
  mkdir -p "$context/rootfs$(dirname "$lib")"
  cp -L "$lib" "$context/rootfs$lib"
done

mkdir -p "$img_dir"
old_id="$(bah images --noheading --format '{{.ID}}' "$image" 2>/dev/null || true)"
bah build --quiet --isolation chroot --layers=false -f "$root/Containerfile" -t "$image" "$context" >/dev/null
rm -f "$archive"
bah push --quiet "$image" "oci-archive:$archive:$image"
t2="$(now)"
# The image this build replaced, if any, is now untagged: free its storage.
new_id="$(bah images --noheading --format '{{.ID}}' "$image")"
if [[ -n "$old_id" && "$old_id" != "$new_id" ]]; then bah rmi "$old_id" >/dev/null 2>&1 || true; fi

rootfs_bytes="$(du -sb "$context/rootfs" | cut -f1)"
archive_bytes="$(stat -c %s "$archive")"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "libraries: ${libs[*]}"
# Each binary as staged (README.md's image section names each, from AETHER_IMAGE_BINS).
sizes=()
for b in "${BINS[@]}"; do sizes+=("$b $(mib "$(stat -c %s "$context/rootfs/usr/local/bin/$b")")"); done
echo "binaries: ${#BINS[@]} (scripts/lib.sh AETHER_IMAGE_BINS): $(IFS=,; echo "${sizes[*]}" | sed 's/,/, /g')"
echo "image size: $(mib "$rootfs_bytes") unpacked ($(printf '%s ' "${BINS[@]}")and ${#libs[@]} libraries), $(mib "$archive_bytes") as the OCI archive"
echo "build time: cargo build --release and the static plugin $(secs "$t0" "$t1") s, image (stage, buildah build, push) $(secs "$t1" "$t2") s, total $(secs "$t0" "$t2") s"
echo "image: $image (id ${new_id:0:12}), archive $archive"
