// Package docker is overlayd's real-engine suite: it installs Debian's
// docker.io and busybox-static when missing, starts its own dockerd engines
// (each in a private network and mount namespace, never touching a system
// daemon) and drives overlayd through the docker CLI, as a legacy plugin and
// as a managed plugin. The tests need root; without it they skip.
//
// Only tests live here; this file makes the directory a package.
package docker
