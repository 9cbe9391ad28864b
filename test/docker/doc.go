// Package docker is overlayd's real-engine suite: it installs Debian's
// docker.io and busybox-static when missing, starts its own dockerd engines
// (each in a private network and mount namespace, never touching a system
// daemon) and drives overlayd through the docker CLI, as a legacy plugin and
// as a managed plugin. OVERLAYD_TEST_ENGINE picks the engine: 20.10 (Debian
// 12's docker.io, the default), 26.1 (Debian 13's packages) or 28.5 (Debian
// unstable's, with docker compose 2), both fetched into a cache directory;
// see engines_test.go. The tests need root; without it
// they skip.
//
// Only tests live here; this file makes the directory a package.
package docker
