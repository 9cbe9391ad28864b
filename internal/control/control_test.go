package control

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
}

func TestClientErrorWhenDaemonDown(t *testing.T) {
	_, err := NewClient(filepath.Join(t.TempDir(), "none.sock")).Get("/v1/status")
	if err == nil || !strings.Contains(err.Error(), "is overlayd running") {
		t.Fatalf("error %v", err)
	}
}
