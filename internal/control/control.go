// Package control serves overlayd's local control API on a unix socket
// (mode 0600: root only) and is its client: `overlayd status`, `overlayd
// keys rotate` and `overlayd leave` talk to a running daemon through it.
package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// Handlers are the daemon's answers. Each may be nil (501).
type Handlers struct {
	Status func() any
	// Rotate starts a cluster-wide key rotation and returns what the new
	// target is.
	Rotate func() (any, error)
	// Leave makes this host leave the cluster for good (decommissioning).
	Leave func() (any, error)
	// Reclaim makes this host the owner of the address space of node, a
	// host gone for good (`overlayd ipam reclaim NODE`); ctx ends when the
	// client gives up.
	Reclaim func(ctx context.Context, node string) (any, error)
}

// Server is a running control socket.
type Server struct {
	srv  *http.Server
	path string
	done chan error // receives why serving stopped, once
}

// Serve listens on path (replacing a stale socket) and serves h until Close.
func Serve(path string, h Handlers) (*Server, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("failed to create control socket directory for %s: %w", path, err)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("control socket %s is in use by another process", path)
	}
	os.Remove(path)
	// Create the socket with no access for others from the first moment.
	l, err := listenPrivate(path)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		if h.Status == nil {
			http.Error(w, "status is not available", http.StatusNotImplemented)
			return
		}
		writeJSON(w, http.StatusOK, h.Status())
	})
	action := func(name string, fn func() (any, error)) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if fn == nil {
				http.Error(w, name+" is not available", http.StatusNotImplemented)
				return
			}
			res, err := fn()
			if err != nil {
				writeJSON(w, http.StatusConflict, map[string]string{"error": err.Error()})
				return
			}
			writeJSON(w, http.StatusOK, res)
		}
	}
	mux.HandleFunc("POST /v1/keys/rotate", action("key rotation", h.Rotate))
	mux.HandleFunc("POST /v1/leave", action("leaving the cluster", h.Leave))
	mux.HandleFunc("POST /v1/ipam/reclaim/{node}", func(w http.ResponseWriter, r *http.Request) {
		if h.Reclaim == nil {
			http.Error(w, "reclaiming address space is not available", http.StatusNotImplemented)
			return
		}
		action("reclaiming address space", func() (any, error) { return h.Reclaim(r.Context(), r.PathValue("node")) })(w, r)
	})
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, path: path, done: make(chan error, 1)}
	go func() {
		err := s.srv.Serve(l)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	return s, nil
}

// Done receives the error that stopped serving other than Close (nil after
// Close), once.
func (s *Server) Done() <-chan error { return s.done }

// listenPrivate listens on path with a socket that nobody but its owner can
// connect to from the first moment: it binds in a fresh directory only the
// owner can enter, restricts the socket's mode, then renames it into place.
// (Changing the umask instead would change it for the whole process.)
func listenPrivate(path string) (net.Listener, error) {
	tmpDir, err := os.MkdirTemp(filepath.Dir(path), ".control-")
	if err != nil {
		return nil, fmt.Errorf("failed to create a private directory next to %s: %w", path, err)
	}
	defer os.RemoveAll(tmpDir)
	tmp := filepath.Join(tmpDir, "s")
	l, err := net.Listen("unix", tmp)
	if err != nil {
		return nil, fmt.Errorf("failed to listen on control socket %s: %w", path, err)
	}
	// The path changes below: remove the socket in Close, not on the
	// listener's close.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("failed to set mode of control socket %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		l.Close()
		return nil, fmt.Errorf("failed to move control socket into place at %s: %w", path, err)
	}
	return l, nil
}

// Close stops serving and removes the socket.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	os.Remove(s.path)
	return err
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// Client talks to a daemon's control socket.
type Client struct {
	path string
	http *http.Client
}

// NewClient returns a client for the socket at path.
func NewClient(path string) *Client {
	return &Client{path: path, http: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		},
	}}}
}

// ReclaimPath is the control path of `overlayd ipam reclaim NODE`.
func ReclaimPath(node string) string { return "/v1/ipam/reclaim/" + url.PathEscape(node) }

// Get fetches path (e.g. "/v1/status") and returns the raw JSON body.
func (c *Client) Get(p string) ([]byte, error) { return c.do(http.MethodGet, p) }

// Post posts to path and returns the raw JSON body.
func (c *Client) Post(p string) ([]byte, error) { return c.do(http.MethodPost, p) }

func (c *Client) do(method, p string) ([]byte, error) {
	req, _ := http.NewRequest(method, "http://overlayd"+p, nil)
	resp, err := c.http.Do(req)
	if err != nil {
		// The cause only: the URL and "dial unix <path>" would repeat
		// what the message says.
		var ne *net.OpError
		if errors.As(err, &ne) {
			return nil, fmt.Errorf("cannot reach overlayd's control socket %s (is overlayd running? see --control-socket): %w", c.path, ne.Err)
		}
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("control socket %s: %s %s: %w", c.path, method, p, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		var e struct{ Error string }
		if json.Unmarshal(body, &e) == nil && e.Error != "" {
			return nil, errors.New(e.Error)
		}
		return nil, fmt.Errorf("%s %s: %s: %s", method, p, resp.Status, body)
	}
	return body, nil
}
