// Command overlayd is a Docker network plugin that joins containers on many
// hosts into one network over VXLAN. With no command it serves the plugin
// API; see `overlayd --help`.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/control"
	"github.com/overlayd/overlayd/internal/daemon"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	cmd := "serve"
	if len(args) > 0 && (args[0] == "serve" || args[0] == "help" || args[0] == "status" || args[0] == "keys" || args[0] == "leave") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "help":
		config.Usage(os.Stdout, "overlayd")
		return 0
	case "status":
		return status(args)
	case "keys":
		return keys(args)
	case "leave":
		return leave(args)
	}
	st, err := config.Parse(args, config.Env)
	if errors.Is(err, flag.ErrHelp) {
		config.Usage(os.Stdout, "overlayd")
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd: %v\n\n", err)
		config.Usage(os.Stderr, "overlayd")
		return 2
	}
	// Logs go to stdout: dockerd shows a managed plugin's stderr as errors.
	log := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: st.LogLevel}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := daemon.Run(ctx, st, log); err != nil {
		log.Error("overlayd failed", "error", err)
		return 1
	}
	return 0
}

// controlFlags parses the flags of the client commands.
func controlFlags(name string, args []string, jsonFlag *bool) (*control.Client, error) {
	fs := flag.NewFlagSet("overlayd "+name, flag.ContinueOnError)
	sock := fs.String("control-socket", envOr("OVERLAYD_CONTROL_SOCKET", config.DefaultControlSocket), "control socket of the running overlayd")
	if jsonFlag != nil {
		fs.BoolVar(jsonFlag, "json", false, "print JSON")
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
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
func status(args []string) int {
	var asJSON bool
	c, err := controlFlags("status", args, &asJSON)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd status: %v\n", err)
		return 2
	}
	body, err := c.Get("/v1/status")
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd status: %v\n", err)
		return 1
	}
	if asJSON {
		os.Stdout.Write(body)
		return 0
	}
	var r daemon.StatusReport
	if err := json.Unmarshal(body, &r); err != nil {
		fmt.Fprintf(os.Stderr, "overlayd status: unexpected answer: %v\n", err)
		return 1
	}
	r.Render(os.Stdout)
	return 0
}

// keys handles `overlayd keys rotate`.
func keys(args []string) int {
	if len(args) == 0 || args[0] != "rotate" {
		fmt.Fprintln(os.Stderr, "usage: overlayd keys rotate [--control-socket PATH]")
		return 2
	}
	c, err := controlFlags("keys rotate", args[1:], nil)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd keys rotate: %v\n", err)
		return 2
	}
	body, err := c.Post("/v1/keys/rotate")
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd keys rotate: %v\n", err)
		return 1
	}
	os.Stdout.Write(body)
	return 0
}

// leave handles `overlayd leave`: decommission this host. Stopping the
// daemon never leaves the cluster (the others keep its peers through a
// restart); this does, and the others remove its records at once.
func leave(args []string) int {
	c, err := controlFlags("leave", args, nil)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd leave: %v\n", err)
		return 2
	}
	body, err := c.Post("/v1/leave")
	if err != nil {
		fmt.Fprintf(os.Stderr, "overlayd leave: %v\n", err)
		return 1
	}
	os.Stdout.Write(body)
	return 0
}
