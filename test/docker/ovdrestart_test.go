package docker

import (
	"strconv"
	"testing"
	"time"
)

// TestOverlaydRestart restarts overlayd (legacy plugin) under running
// containers: the kernel state stays, so pings must go on (the lost ones are
// counted), and the new process must adopt what the old one made, so that
// `docker rm -f` and `docker network rm` still clean up completely (dockerd
// replays nothing: it only sends Leave/DeleteEndpoint/DeleteNetwork for ids
// the new process never saw).
func TestOverlaydRestart(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	o := e.startOverlayd()
	e.createNetwork("overlayd", "n1", "-o", "vni=4601", "--subnet", "192.0.2.0/26")
	e.run("c1", "n1", "192.0.2.2")
	e.run("c2", "n1", "192.0.2.3")
	e.mustPing("c1", "192.0.2.3")

	// 10 pings a second for 6 s, overlayd restarted in the middle.
	const count = 60
	type result struct {
		out string
		err error
	}
	pings := make(chan result, 1)
	go func() {
		out, err := e.docker("exec", "c1", "ping", "-i", "0.1", "-c", strconv.Itoa(count), "-W", "1", "192.0.2.3")
		pings <- result{out, err}
	}()
	time.Sleep(2 * time.Second)
	if err := o.stop(); err != nil {
		t.Errorf("overlayd stop: %v", err)
	}
	if err := o.start(); err != nil { // logs the start-to-socket time
		t.Fatal(err)
	}
	r := <-pings
	m := lossRE.FindStringSubmatch(r.out)
	if m == nil {
		t.Fatalf("ping during the restart: %v\n%s", r.err, r.out)
	}
	sent, _ := strconv.Atoi(m[1])
	got, _ := strconv.Atoi(m[2])
	t.Logf("pings lost during an overlayd restart: %d of %d (every 100ms)", sent-got, sent)
	if got < sent-2 {
		t.Errorf("lost %d of %d pings across an overlayd restart; the kernel state should carry them", sent-got, sent)
	}
	e.mustPing("c2", "192.0.2.2")
	if st, err := o.status(); err != nil || !hasNumber(st, 4601) {
		t.Errorf("overlayd status after the restart does not show the network (VNI 4601): %v\n%s", err, st)
	}

	// The new process knows the network: a new container joins it.
	e.run("c3", "n1", "192.0.2.4")
	e.mustPing("c3", "192.0.2.2")

	e.must("rm", "-f", "c1", "c2", "c3")
	e.must("network", "rm", "n1")
	e.waitClean(o)
}
