package pluginapi

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/docker/go-plugins-helpers/ipam"
	"github.com/docker/go-plugins-helpers/network"
)

// These tests check the HTTP layer only (routing, activation, encoding):
// the driver and the allocator behind it are recording stand-ins, because
// the real ones need a kernel and a cluster that say nothing about this
// package. internal/daemon's tests drive the real ones over the socket.

// stubNetwork answers NetworkDriver.GetCapabilities; every other method
// would panic (nil embedded interface), which the tests do not call.
type stubNetwork struct{ network.Driver }

func (stubNetwork) GetCapabilities() (*network.CapabilitiesResponse, error) {
	return &network.CapabilitiesResponse{Scope: network.LocalScope, ConnectivityScope: network.GlobalScope}, nil
}

// recordingIPAM records each call with its request and whether it had a
// live context, and answers fixed values (or fail).
type recordingIPAM struct {
	mu    sync.Mutex
	calls []string
	reqs  []any
	fail  error
}

func (s *recordingIPAM) rec(ctx context.Context, call string, req any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ctx == nil || ctx.Err() != nil {
		call += "(no live context)"
	}
	s.calls = append(s.calls, call)
	s.reqs = append(s.reqs, req)
	return s.fail
}

func (s *recordingIPAM) GetCapabilities(ctx context.Context) (*IPAMCapabilities, error) {
	return &IPAMCapabilities{RequiresMACAddress: true, RequiresRequestReplay: true}, s.rec(ctx, "GetCapabilities", nil)
}
func (s *recordingIPAM) GetDefaultAddressSpaces(ctx context.Context) (*ipam.AddressSpacesResponse, error) {
	return &ipam.AddressSpacesResponse{LocalDefaultAddressSpace: "l", GlobalDefaultAddressSpace: "g"}, s.rec(ctx, "GetDefaultAddressSpaces", nil)
}
func (s *recordingIPAM) RequestPool(ctx context.Context, r *ipam.RequestPoolRequest) (*ipam.RequestPoolResponse, error) {
	return &ipam.RequestPoolResponse{PoolID: "overlayd:" + r.Pool, Pool: r.Pool, Data: map[string]string{"com.docker.network.gateway": "198.51.100.1/24"}},
		s.rec(ctx, "RequestPool", *r)
}
func (s *recordingIPAM) ReleasePool(ctx context.Context, r *ipam.ReleasePoolRequest) error {
	return s.rec(ctx, "ReleasePool", *r)
}
func (s *recordingIPAM) RequestAddress(ctx context.Context, r *ipam.RequestAddressRequest) (*ipam.RequestAddressResponse, error) {
	return &ipam.RequestAddressResponse{Address: "198.51.100.7/24"}, s.rec(ctx, "RequestAddress", *r)
}
func (s *recordingIPAM) ReleaseAddress(ctx context.Context, r *ipam.ReleaseAddressRequest) error {
	return s.rec(ctx, "ReleaseAddress", *r)
}

func serve(t *testing.T, id IPAM) *http.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "p.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go New(stubNetwork{}, id).Serve(l)
	t.Cleanup(func() { l.Close() })
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
}

func call(t *testing.T, c *http.Client, method, path, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, "http://plugin"+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// TestActivateListsBothDrivers: dockerd's activation (POST, as it sends
// it; GET too) lists NetworkDriver and IpamDriver, so the one socket
// serves `-d overlayd --ipam-driver overlayd`.
func TestActivateListsBothDrivers(t *testing.T) {
	c := serve(t, &recordingIPAM{})
	for _, m := range []string{http.MethodPost, http.MethodGet} {
		code, body := call(t, c, m, "/Plugin.Activate", "")
		var got struct{ Implements []string }
		if err := json.Unmarshal([]byte(body), &got); err != nil || code != 200 {
			t.Fatalf("%s /Plugin.Activate: %d %q (%v)", m, code, body, err)
		}
		if !reflect.DeepEqual(got.Implements, []string{"NetworkDriver", "IpamDriver"}) {
			t.Errorf("%s /Plugin.Activate implements %v, want [NetworkDriver IpamDriver]", m, got.Implements)
		}
	}
	// The network driver's own paths are still served.
	code, body := call(t, c, http.MethodPost, "/NetworkDriver.GetCapabilities", "{}")
	if code != 200 || !strings.Contains(body, `"Scope":"local"`) {
		t.Errorf("NetworkDriver.GetCapabilities: %d %s", code, body)
	}
}

// TestEveryIPAMPathReachesItsMethod: each IpamDriver path decodes its
// request into the right call, with the HTTP request's context, and
// encodes the answer as libnetwork reads it; errors become {"Err": text}
// with status 500; a body that is not JSON is refused naming the call, and
// nothing is called.
func TestEveryIPAMPathReachesItsMethod(t *testing.T) {
	id := &recordingIPAM{}
	c := serve(t, id)
	for _, tc := range []struct {
		path, body, want, call string
		req                    any
	}{
		{PathIPAMCapabilities, "null", `{"RequiresMACAddress":true,"RequiresRequestReplay":true}`, "GetCapabilities", nil},
		{PathIPAMAddressSpaces, "", `{"LocalDefaultAddressSpace":"l","GlobalDefaultAddressSpace":"g"}`, "GetDefaultAddressSpaces", nil},
		{PathIPAMRequestPool, `{"AddressSpace":"overlayd","Pool":"198.51.100.0/24","SubPool":"","Options":{"a":"b"},"V6":false}`,
			`{"PoolID":"overlayd:198.51.100.0/24","Pool":"198.51.100.0/24","Data":{"com.docker.network.gateway":"198.51.100.1/24"}}`, "RequestPool",
			ipam.RequestPoolRequest{AddressSpace: "overlayd", Pool: "198.51.100.0/24", Options: map[string]string{"a": "b"}}},
		{PathIPAMReleasePool, `{"PoolID":"overlayd:198.51.100.0/24"}`, `{}`, "ReleasePool", ipam.ReleasePoolRequest{PoolID: "overlayd:198.51.100.0/24"}},
		{PathIPAMRequestAddress, `{"PoolID":"p","Address":"198.51.100.7","Options":{"com.docker.network.endpoint.macaddress":"02:42:c6:33:64:07"}}`,
			`{"Address":"198.51.100.7/24","Data":null}`, "RequestAddress",
			ipam.RequestAddressRequest{PoolID: "p", Address: "198.51.100.7", Options: map[string]string{"com.docker.network.endpoint.macaddress": "02:42:c6:33:64:07"}}},
		{PathIPAMReleaseAddress, `{"PoolID":"p","Address":"198.51.100.7"}`, `{}`, "ReleaseAddress", ipam.ReleaseAddressRequest{PoolID: "p", Address: "198.51.100.7"}},
	} {
		id.calls, id.reqs = nil, nil
		code, body := call(t, c, http.MethodPost, tc.path, tc.body)
		if code != 200 || body != tc.want {
			t.Errorf("%s: %d %s, want 200 %s", tc.path, code, body, tc.want)
		}
		if len(id.calls) != 1 || id.calls[0] != tc.call || !reflect.DeepEqual(id.reqs[0], tc.req) {
			t.Errorf("%s: calls %v with %+v, want %s with %+v", tc.path, id.calls, id.reqs, tc.call, tc.req)
		}
	}

	id.fail = errors.New("198.51.100.7 is in use on this host")
	code, body := call(t, c, http.MethodPost, PathIPAMRequestAddress, `{"PoolID":"p","Address":"198.51.100.7"}`)
	if code != 500 || body != `{"Err":"198.51.100.7 is in use on this host"}` {
		t.Errorf("refused RequestAddress: %d %s", code, body)
	}
	id.calls = nil
	code, body = call(t, c, http.MethodPost, PathIPAMRequestPool, `{"Pool": 5}`)
	if code != 500 || !strings.Contains(body, "IpamDriver.RequestPool: the request body is not a JSON RequestPool request") || !strings.Contains(body, "Pool") {
		t.Errorf("malformed RequestPool: %d %s", code, body)
	}
	if len(id.calls) != 0 {
		t.Errorf("a malformed request reached the allocator: %v", id.calls)
	}
}
