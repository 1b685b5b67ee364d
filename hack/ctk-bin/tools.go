//go:build tools

// Package tools pins the NVIDIA Container Toolkit commands this module builds (hack/build-bins):
// nvidia-ctk generates CDI specs from a driver tree, nvidia-cdi-hook is what those specs' hooks run.
package tools

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
)
