package solo

import "github.com/overlayd/overlayd/driver"

// A host alone's control plane is every one of the driver's interfaces.
var (
	_ driver.LocalPublisher   = ControlPlane{}
	_ driver.PeerSource       = ControlPlane{}
	_ driver.DefinitionSource = ControlPlane{}
	_ driver.Membership       = ControlPlane{}
)
