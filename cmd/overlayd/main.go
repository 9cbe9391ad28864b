// Command overlayd is a Docker network plugin that joins containers on many
// hosts into one network over VXLAN. With no command it serves the plugin
// API; see `overlayd --help`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/daemon"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	cmd := "serve"
	if len(args) > 0 && (args[0] == "serve" || args[0] == "help") {
		cmd, args = args[0], args[1:]
	}
	if cmd == "help" {
		config.Usage(os.Stdout, "overlayd")
		return 0
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
