// Package pluginapi serves Docker's two remote plugin APIs that overlayd
// implements on one socket: the network driver (NetworkDriver.*) and the
// address management driver (IpamDriver.*), so `docker network create -d
// overlayd --ipam-driver overlayd` talks to one process. Plugin.Activate
// lists both.
//
// The network side is go-plugins-helpers' network handler. Its mux is
// private and already answers Plugin.Activate with NetworkDriver only, so
// the IPAM paths are registered on it with HandleFunc, and the activation
// is answered by method-specific patterns ("POST /Plugin.Activate", "GET
// /Plugin.Activate"), which net/http's mux prefers over the helper's
// method-less one. dockerd activates with POST. The IPAM side is encoded
// here rather than by the helpers' ipam package, whose capabilities lack
// RequiresRequestReplay and whose handlers drop the request's context.
package pluginapi

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"

	"github.com/docker/go-plugins-helpers/ipam"
	"github.com/docker/go-plugins-helpers/network"
	"github.com/docker/go-plugins-helpers/sdk"
)

// Manifest is the Plugin.Activate answer.
const Manifest = `{"Implements": ["NetworkDriver", "IpamDriver"]}`

// The IpamDriver paths (libnetwork's ipamapi).
const (
	PathIPAMCapabilities   = "/IpamDriver.GetCapabilities"
	PathIPAMAddressSpaces  = "/IpamDriver.GetDefaultAddressSpaces"
	PathIPAMRequestPool    = "/IpamDriver.RequestPool"
	PathIPAMReleasePool    = "/IpamDriver.ReleasePool"
	PathIPAMRequestAddress = "/IpamDriver.RequestAddress"
	PathIPAMReleaseAddress = "/IpamDriver.ReleaseAddress"
)

// IPAMCapabilities is the IpamDriver.GetCapabilities answer, with
// libnetwork's field names.
type IPAMCapabilities struct {
	// RequiresMACAddress: dockerd passes the endpoint's MAC in
	// RequestAddress's options.
	RequiresMACAddress bool
	// RequiresRequestReplay: dockerd re-requests the pools and addresses
	// of existing networks and endpoints when it restarts.
	RequiresRequestReplay bool
}

// IPAM is the IpamDriver side, in the remote API's request and response
// types. ctx is the HTTP request's: it ends when dockerd gives up on the
// call. An error is returned to dockerd as its text.
type IPAM interface {
	GetCapabilities(ctx context.Context) (*IPAMCapabilities, error)
	GetDefaultAddressSpaces(ctx context.Context) (*ipam.AddressSpacesResponse, error)
	RequestPool(ctx context.Context, r *ipam.RequestPoolRequest) (*ipam.RequestPoolResponse, error)
	ReleasePool(ctx context.Context, r *ipam.ReleasePoolRequest) error
	RequestAddress(ctx context.Context, r *ipam.RequestAddressRequest) (*ipam.RequestAddressResponse, error)
	ReleaseAddress(ctx context.Context, r *ipam.ReleaseAddressRequest) error
}

// Handler serves both APIs.
type Handler struct {
	h *network.Handler
}

// New builds the handler: nd answers NetworkDriver.*, id IpamDriver.*.
func New(nd network.Driver, id IPAM) *Handler {
	h := network.NewHandler(nd)
	activate := func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", sdk.DefaultContentTypeV1_1)
		fmt.Fprintln(w, Manifest)
	}
	h.HandleFunc("POST /Plugin.Activate", activate)
	h.HandleFunc("GET /Plugin.Activate", activate)

	h.HandleFunc(PathIPAMCapabilities, handle("GetCapabilities", false, func(ctx context.Context, _ *struct{}) (*IPAMCapabilities, error) {
		return id.GetCapabilities(ctx)
	}))
	h.HandleFunc(PathIPAMAddressSpaces, handle("GetDefaultAddressSpaces", false, func(ctx context.Context, _ *struct{}) (*ipam.AddressSpacesResponse, error) {
		return id.GetDefaultAddressSpaces(ctx)
	}))
	h.HandleFunc(PathIPAMRequestPool, handle("RequestPool", true, id.RequestPool))
	h.HandleFunc(PathIPAMReleasePool, handle("ReleasePool", true, func(ctx context.Context, r *ipam.ReleasePoolRequest) (struct{}, error) {
		return struct{}{}, id.ReleasePool(ctx, r)
	}))
	h.HandleFunc(PathIPAMRequestAddress, handle("RequestAddress", true, id.RequestAddress))
	h.HandleFunc(PathIPAMReleaseAddress, handle("ReleaseAddress", true, func(ctx context.Context, r *ipam.ReleaseAddressRequest) (struct{}, error) {
		return struct{}{}, id.ReleaseAddress(ctx, r)
	}))
	return &Handler{h: h}
}

// Serve serves on l until it is closed.
func (h *Handler) Serve(l net.Listener) error { return h.h.Serve(l) }

// handle serves one IpamDriver call: it decodes the request body into a
// new Req (when the call has one), calls fn with the HTTP request's
// context, and writes its answer, or its error as libnetwork's error
// answer ({"Err": text}, status 500). A body that is not the call's JSON
// object is answered with an error naming the call and what was wrong
// (dockerd shows it), and fn is not called.
func handle[Req, Res any](call string, body bool, fn func(context.Context, *Req) (Res, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		req := new(Req)
		if body {
			if err := json.NewDecoder(r.Body).Decode(req); err != nil {
				sdk.EncodeResponse(w, ipam.NewErrorResponse(fmt.Sprintf("IpamDriver.%s: the request body is not a JSON %s request: %v", call, call, err)), true)
				return
			}
		}
		res, err := fn(r.Context(), req)
		if err != nil {
			sdk.EncodeResponse(w, ipam.NewErrorResponse(err.Error()), true)
			return
		}
		sdk.EncodeResponse(w, res, false)
	}
}
