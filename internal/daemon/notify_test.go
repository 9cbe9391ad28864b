package daemon

import (
	"net"
	"path/filepath"
	"testing"
	"time"
)

// TestTellsSystemdWhenServing: under systemd (NOTIFY_SOCKET set, as for a
// Type=notify unit) the daemon sends READY=1 once its plugin socket
// answers, so that docker.service, ordered after it, starts only then.
func TestTellsSystemdWhenServing(t *testing.T) {
	addr := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", addr)
	client, _ := startDaemon(t, "local")

	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 512)
	n, err := conn.Read(buf)
	if err != nil {
		t.Fatalf("no notification on NOTIFY_SOCKET: %v", err)
	}
	if got := string(buf[:n]); got != "READY=1" {
		t.Errorf("notification %q, want READY=1", got)
	}
	// Serving, as the notification said.
	if code, out := post(t, client, "NetworkDriver.GetCapabilities", "{}"); code != 200 {
		t.Errorf("GetCapabilities after READY=1: %d %v", code, out)
	}
}
