// Command overlayd is a Docker network plugin that joins containers on many
// hosts into one network over VXLAN. With no command it serves the plugin
// API; see `overlayd --help`.
//
// Exit status: 0 on success (and after SIGTERM), 1 when the daemon or a
// client command fails, 2 when the settings or arguments are refused. A
// refusal or a failure is one line on stderr, "overlayd: <why>": a managed
// plugin's stderr reaches dockerd's log at level error line by line, so the
// reason is one line there, not buried under the usage text. The usage text
// is printed only when asked for (--help, help).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/control"
	"github.com/overlayd/overlayd/internal/daemon"
	"github.com/overlayd/overlayd/internal/version"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command in args (without the program name) and returns the
// exit status.
func run(args []string, stdout, stderr io.Writer) int {
	cmd := "serve"
	if len(args) > 0 {
		switch a := args[0]; {
		case a == "serve" || a == "help" || a == "version" || config.IsCommand(a):
			cmd, args = a, args[1:]
		case a == "--version" || a == "-version":
			cmd, args = "version", args[1:]
		}
	}
	switch cmd {
	case "help":
		if len(args) > 0 && config.IsCommand(args[0]) {
			config.CommandUsage(stdout, "overlayd", args[0])
		} else {
			config.Usage(stdout, "overlayd")
		}
		return 0
	case "version":
		fmt.Fprintln(stdout, version.Long())
		return 0
	case "status":
		return status(args, stdout, stderr)
	case "keys":
		return keys(args, stdout, stderr)
	case "leave":
		return leave(args, stdout, stderr)
	case "ipam":
		return ipamCmd(args, stdout, stderr)
	}
	st, err := config.Parse(args, config.Env)
	if errors.Is(err, flag.ErrHelp) {
		config.Usage(stdout, "overlayd")
		return 0
	}
	if err != nil {
		return fail(stderr, "", err)
	}
	// Logs go to stdout: dockerd shows a managed plugin's stderr as errors.
	log := slog.New(slog.NewTextHandler(stdout, &slog.HandlerOptions{Level: st.LogLevel}))
	for _, w := range config.UnknownEnv(os.Environ()) {
		log.Warn(w)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := daemon.Run(ctx, st, log); err != nil {
		return fail(stderr, "", err)
	}
	return 0
}

// fail prints err as one line, "overlayd[ cmd]: err", and returns the exit
// status: 2 for refused settings or arguments, 1 otherwise.
func fail(stderr io.Writer, cmd string, err error) int {
	prog := "overlayd"
	if cmd != "" {
		prog += " " + cmd
	}
	fmt.Fprintf(stderr, "%s: %s\n", prog, strings.ReplaceAll(err.Error(), "\n", "; "))
	if _, ok := errors.AsType[*config.Invalid](err); ok {
		return 2
	}
	return 1
}

// clientFlags parses the flags of a client command; help is (nil, nil)
// after the command's usage went to stdout.
func clientFlags(name string, args []string, jsonFlag *bool, stdout io.Writer) (*control.Client, error) {
	fs := flag.NewFlagSet("overlayd "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	sock := fs.String("control-socket", envOr("OVERLAYD_CONTROL_SOCKET", config.DefaultControlSocket), "")
	if jsonFlag != nil {
		fs.BoolVar(jsonFlag, "json", false, "")
	}
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		config.CommandUsage(stdout, "overlayd", name)
		return nil, nil
	} else if err != nil {
		return nil, &config.Invalid{Err: fmt.Errorf("%v (see overlayd %s --help)", err, name)}
	}
	if fs.NArg() > 0 {
		return nil, &config.Invalid{Err: fmt.Errorf("unexpected argument %q (see overlayd %s --help)", fs.Arg(0), name)}
	}
	return control.NewClient(*sock), nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// status prints the running daemon's status.
func status(args []string, stdout, stderr io.Writer) int {
	var asJSON bool
	c, err := clientFlags("status", args, &asJSON, stdout)
	if c == nil && err == nil {
		return 0
	}
	if err != nil {
		return fail(stderr, "status", err)
	}
	body, err := c.Get("/v1/status")
	if err != nil {
		return fail(stderr, "status", err)
	}
	if asJSON {
		stdout.Write(body)
		return 0
	}
	var r daemon.StatusReport
	if err := json.Unmarshal(body, &r); err != nil {
		return fail(stderr, "status", fmt.Errorf("unexpected answer from the daemon: %w", err))
	}
	r.Render(stdout)
	return 0
}

// subcommand checks that args start with cmd's only subcommand sub
// (described as what, e.g. "reclaim NODE"). It returns the exit status and
// false when the command ends here: its usage was asked for, or the
// subcommand is missing or unknown.
func subcommand(cmd, sub, what string, args []string, stdout, stderr io.Writer) (int, bool) {
	switch {
	case len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help" || args[0] == "help"):
		config.CommandUsage(stdout, "overlayd", cmd)
		return 0, false
	case len(args) == 0:
		return fail(stderr, cmd, &config.Invalid{Err: fmt.Errorf("missing subcommand: the only one is %s (see overlayd %s --help)", what, cmd)}), false
	case args[0] != sub:
		return fail(stderr, cmd, &config.Invalid{Err: fmt.Errorf("unknown subcommand %q: the only one is %s (see overlayd %s --help)", args[0], what, cmd)}), false
	}
	return 0, true
}

// keys handles `overlayd keys rotate`.
func keys(args []string, stdout, stderr io.Writer) int {
	if code, ok := subcommand("keys", "rotate", "rotate", args, stdout, stderr); !ok {
		return code
	}
	c, err := clientFlags("keys", args[1:], nil, stdout)
	if c == nil && err == nil {
		return 0
	}
	if err != nil {
		return fail(stderr, "keys rotate", err)
	}
	body, err := c.Post("/v1/keys/rotate")
	if err != nil {
		return fail(stderr, "keys rotate", err)
	}
	stdout.Write(body)
	return 0
}

// leave handles `overlayd leave`: decommission this host. Stopping the
// daemon never leaves the cluster (the others keep its peers through a
// restart); this does, and the others remove its records at once.
func leave(args []string, stdout, stderr io.Writer) int {
	c, err := clientFlags("leave", args, nil, stdout)
	if c == nil && err == nil {
		return 0
	}
	if err != nil {
		return fail(stderr, "leave", err)
	}
	body, err := c.Post("/v1/leave")
	if err != nil {
		return fail(stderr, "leave", err)
	}
	stdout.Write(body)
	return 0
}

// ipamCmd handles `overlayd ipam reclaim NODE`: this host takes over the
// address space of NODE, a host gone for good. The daemon refuses while
// NODE is alive, with the reason.
func ipamCmd(args []string, stdout, stderr io.Writer) int {
	if code, ok := subcommand("ipam", "reclaim", "reclaim NODE", args, stdout, stderr); !ok {
		return code
	}
	args = args[1:]
	var node string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		node, args = args[0], args[1:]
	}
	c, err := clientFlags("ipam", args, nil, stdout)
	if c == nil && err == nil {
		return 0
	}
	if err != nil {
		return fail(stderr, "ipam reclaim", err)
	}
	if node == "" {
		return fail(stderr, "ipam reclaim", &config.Invalid{Err: errors.New("missing NODE: the name of the host whose address space to take over (see overlayd ipam --help)")})
	}
	body, err := c.Post(control.ReclaimPath(node))
	if err != nil {
		return fail(stderr, "ipam reclaim", err)
	}
	stdout.Write(body)
	return 0
}
