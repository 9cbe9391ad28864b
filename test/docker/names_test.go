package docker

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	engineapi "github.com/overlayd/overlayd/internal/engine"
)

// TestEngineNames: the engine client reads, over the engine's API socket,
// each running container's endpoint with its name and aliases (what
// dockerd never sends a driver), and its event watch fires on start and
// on removal, after which the container is gone from the list.
func TestEngineNames(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	e.startOverlayd()
	e.createNetwork("overlayd", "n1", "-o", "vni=4401", "--subnet", "192.0.2.0/26")

	en, err := engineapi.Open(e.sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer en.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes := make(chan struct{}, 64)
	go en.Watch(ctx, 100*time.Millisecond, func() {
		select {
		case changes <- struct{}{}:
		default:
		}
	})
	<-changes // the watch's first call, once its stream is open

	e.run("web", "n1", "192.0.2.2", "--network-alias", "site", "--network-alias", "Front.End")
	epID := e.must("inspect", "-f", "{{(index .NetworkSettings.Networks \"n1\").EndpointID}}", "web")
	select {
	case <-changes:
	case <-time.After(10 * time.Second):
		t.Fatal("no engine event for the container's start within 10 s")
	}
	names, err := en.Names(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := names[epID]
	if !ok {
		t.Fatalf("endpoint %s of web not listed: %v", epID, names)
	}
	for _, want := range []string{"web", "site", "Front.End"} {
		if !slices.Contains(got.Names, want) {
			t.Errorf("names of web's endpoint %v lack %q", got.Names, want)
		}
	}

	e.must("rm", "-f", "web")
	deadline := time.Now().Add(10 * time.Second)
	for {
		names, err := en.Names(ctx)
		if err == nil {
			if _, ok := names[epID]; !ok {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("web's endpoint still listed 10 s after rm -f: %v %v", names, err)
		}
		select {
		case <-changes:
		case <-time.After(100 * time.Millisecond):
		}
	}

	// A socket nobody serves is an error naming it, not a hang.
	bad, err := engineapi.Open(e.dir+"/absent.sock", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if _, err := bad.Names(ctx); err == nil {
		t.Fatal("Names over an absent socket succeeded")
	} else if !strings.Contains(err.Error(), "absent.sock") {
		t.Fatalf("error %q does not name the socket", err)
	}
	if _, err := engineapi.Open("relative.sock", nil); err == nil {
		t.Fatal("a relative socket path was accepted")
	}
}
