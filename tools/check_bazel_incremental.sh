#!/usr/bin/env bash
# Checks which kernel actions rebuilds run, on a copy of the checkout (the steps are listed in
# tools/bazel_support/incremental_steps.sh): no-op rebuilds, a new test case, a test edit, one
# family's module, a shared module, the lock.  tools/check_bazel_determinism.sh
# --then-incremental runs the same steps in its second output base (CI does that).
# Usage: tools/check_bazel_incremental.sh [FAMILY]   (default: the first kernel family package)
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/check_lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/bazel_support/incremental_steps.sh"

copy_checkout "$work/checkout"
incremental_steps "$work/checkout" "$work/base" "${1:-}"
