package netspec

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
)

// WireVersion is the encoding's version. A host refuses a spec of a later
// version rather than create a network with settings it would drop.
const WireVersion = 1

// MaxWire bounds an encoded spec (one gossip message carries it).
const MaxWire = 16 << 10

// wireSpec is the encoding: JSON, whose maps encoding/json writes in key
// order, so that equal specs encode to equal bytes (hashes, digests).
type wireSpec struct {
	V           int               `json:"v"`
	Name        string            `json:"name"`
	Options     map[string]string `json:"opts,omitempty"`
	IPAMDriver  string            `json:"ipam"`
	IPAMOptions map[string]string `json:"ipam_opts,omitempty"`
	Pools       []wirePool        `json:"pools,omitempty"`
	Internal    bool              `json:"internal,omitempty"`
	IPv4        bool              `json:"ipv4,omitempty"`
	IPv6        bool              `json:"ipv6,omitempty"`
	Attachable  bool              `json:"attachable,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
}

type wirePool struct {
	Subnet  netip.Prefix          `json:"subnet"`
	IPRange netip.Prefix          `json:"range,omitzero"`
	Gateway netip.Addr            `json:"gw,omitzero"`
	Aux     map[string]netip.Addr `json:"aux,omitempty"`
}

// Encode is s's canonical encoding. s must be valid (Validate).
func (s *Spec) Encode() ([]byte, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	w := wireSpec{V: WireVersion, Name: s.Name, Options: s.Options, IPAMDriver: s.IPAMDriver, IPAMOptions: s.IPAMOptions,
		Internal: s.Internal, IPv4: s.IPv4, IPv6: s.IPv6, Attachable: s.Attachable, Labels: s.Labels}
	for _, p := range s.Pools {
		w.Pools = append(w.Pools, wirePool(p))
	}
	b, err := json.Marshal(&w)
	if err != nil {
		return nil, fmt.Errorf("network %q: encode: %w", s.Name, err)
	}
	if len(b) > MaxWire {
		return nil, fmt.Errorf("network %q: encoded definition is %d bytes: at most %d", s.Name, len(b), MaxWire)
	}
	return b, nil
}

// Decode reads an encoded spec from a peer or the state file, refusing
// anything Encode would not write: another version, unknown fields, values
// outside the limits, malformed addresses.
func Decode(b []byte) (Spec, error) {
	if len(b) > MaxWire {
		return Spec{}, fmt.Errorf("network definition is %d bytes: at most %d", len(b), MaxWire)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var w wireSpec
	if err := dec.Decode(&w); err != nil {
		return Spec{}, fmt.Errorf("network definition: %w", err)
	}
	if dec.More() {
		return Spec{}, fmt.Errorf("network definition: data after the object")
	}
	if w.V != WireVersion {
		return Spec{}, fmt.Errorf("network definition %q: version %d, this overlayd reads %d (upgrade it)", w.Name, w.V, WireVersion)
	}
	s := Spec{Name: w.Name, Options: clone(w.Options), IPAMDriver: w.IPAMDriver, IPAMOptions: clone(w.IPAMOptions),
		Internal: w.Internal, IPv4: w.IPv4, IPv6: w.IPv6, Attachable: w.Attachable, Labels: clone(w.Labels)}
	for _, p := range w.Pools {
		s.Pools = append(s.Pools, Pool{Subnet: p.Subnet, IPRange: p.IPRange, Gateway: p.Gateway, Aux: cloneAux(p.Aux)})
	}
	if err := s.Validate(); err != nil {
		return Spec{}, err
	}
	return s, nil
}
