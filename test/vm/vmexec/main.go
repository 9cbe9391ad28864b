// Command vmexec runs one static test binary inside the test VM (Debian's
// cloud kernel under qemu, see package vm) and exits with its status, so
// any package's tests can run on a kernel with ESP:
//
//	CGO_ENABLED=0 go test -exec "go run github.com/overlayd/overlayd/test/vm/vmexec" ./encryption -v
//
// Exit status 124 means the VM timed out, 125 a guest kernel panic, 126 no
// status reported, 127 the VM could not be prepared.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/overlayd/overlayd/test/vm"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: vmexec TEST-BINARY [ARGS...]")
		os.Exit(2)
	}
	ctx := context.Background()
	fail := func(code int, err error) {
		fmt.Fprintln(os.Stderr, "vmexec:", err)
		os.Exit(code)
	}
	if err := vm.EnsureTools(ctx); err != nil {
		fail(127, err)
	}
	k, err := vm.FetchKernel(ctx, vm.DefaultCacheDir())
	if err != nil {
		fail(127, err)
	}
	res, err := vm.Run(ctx, vm.Options{
		Kernel:          k,
		Modules:         vm.GuestModules,
		OptionalModules: vm.GuestOptionalModules,
		Binaries:        []vm.Binary{{Name: "payload.test", Path: os.Args[1], Args: os.Args[2:]}},
		Env:             map[string]string{"OVERLAYD_VM_GUEST": "1"},
		Timeout:         10 * time.Minute,
		Console:         os.Stdout,
	})
	switch {
	case errors.Is(err, vm.ErrTimeout):
		fail(124, err)
	case errors.Is(err, vm.ErrPanic):
		fail(125, err)
	case err != nil && res != nil:
		fail(126, err)
	case err != nil:
		fail(127, err)
	}
	os.Exit(res.Exits["payload.test"])
}
