package control

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestServeStatusAndRotate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c", "control.sock")
	rotated := 0
	s, err := Serve(path, Handlers{
		Status: func() any { return map[string]int{"networks": 2} },
		Rotate: func() (any, error) {
			rotated++
			if rotated > 1 {
				return nil, errors.New("a rotation is already in progress")
			}
			return map[string]int{"target": 2}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("control socket mode %v, want 0600 (err %v)", fi.Mode().Perm(), err)
	}
	c := NewClient(path)
	body, err := c.Get("/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]int
	if err := json.Unmarshal(body, &st); err != nil || st["networks"] != 2 {
		t.Fatalf("status %s: %v", body, err)
	}
	if _, err := c.Post("/v1/keys/rotate"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Post("/v1/keys/rotate"); err == nil || !strings.Contains(err.Error(), "already in progress") {
		t.Fatalf("second rotation: %v", err)
	}
	if _, err := Serve(path, Handlers{}); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second server on a live socket: %v", err)
	}
	if _, err := c.Post("/v1/leave"); err == nil || !strings.Contains(err.Error(), "not available") {
		t.Fatalf("leave without a handler: %v", err)
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 1 {
		t.Fatalf("the socket's directory holds %v, want only the socket", entries)
	}
	s.Close()
	select {
	case err := <-s.Done():
		if err != nil {
			t.Fatalf("Done after Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Done not signalled after Close")
	}
}

// `overlayd ipam reclaim NODE` reaches the handler with the node's name
// (escaped on the way: names may hold anything the cluster accepts) and a
// live context; a refusal comes back as the error's text.
func TestReclaim(t *testing.T) {
	path := filepath.Join(t.TempDir(), "control.sock")
	var got []string
	s, err := Serve(path, Handlers{Reclaim: func(ctx context.Context, node string) (any, error) {
		if ctx.Err() != nil {
			t.Error("reclaim called with a dead context")
		}
		got = append(got, node)
		if node == "alive host" {
			return nil, errors.New(`refused: member "alive host" is alive; reclaim only a host that is gone for good`)
		}
		return map[string]string{"node": node}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := NewClient(path)
	body, err := c.Post(ReclaimPath("h3/old"))
	if err != nil || !strings.Contains(string(body), `"node": "h3/old"`) {
		t.Fatalf("reclaim h3/old: %s %v", body, err)
	}
	if _, err := c.Post(ReclaimPath("alive host")); err == nil || err.Error() != `refused: member "alive host" is alive; reclaim only a host that is gone for good` {
		t.Fatalf("refused reclaim: %v", err)
	}
	if len(got) != 2 || got[0] != "h3/old" || got[1] != "alive host" {
		t.Fatalf("handler got %q", got)
	}
	s2path := filepath.Join(t.TempDir(), "control.sock")
	s2, err := Serve(s2path, Handlers{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, err := NewClient(s2path).Post(ReclaimPath("h3")); err == nil || !strings.Contains(err.Error(), "not available") {
		t.Fatalf("reclaim without a handler: %v", err)
	}
}

// The socket is made without touching the process's umask (the old code
// changed it for every goroutine of the daemon while binding).
func TestServeKeepsUmask(t *testing.T) {
	old := syscall.Umask(0o022)
	defer syscall.Umask(old)
	var seen []int
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			m := syscall.Umask(0o022) // read it (Umask sets and returns the old one)
			if m != 0o022 {
				seen = append(seen, m)
			}
		}
	}()
	for i := 0; i < 20; i++ {
		s, err := Serve(filepath.Join(t.TempDir(), "control.sock"), Handlers{})
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
	close(stop)
	<-done
	if len(seen) != 0 {
		t.Fatalf("the process umask changed while serving: saw %o", seen)
	}
}

func TestClientErrorWhenDaemonDown(t *testing.T) {
	_, err := NewClient(filepath.Join(t.TempDir(), "none.sock")).Get("/v1/status")
	if err == nil || !strings.Contains(err.Error(), "is overlayd running") {
		t.Fatalf("error %v", err)
	}
}
