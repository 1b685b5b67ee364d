//go:build tools

// Package tools pins the Kueue controller-manager this module builds (hack/build-bins).
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
