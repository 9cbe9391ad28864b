package daemon

import "github.com/prometheus/client_golang/prometheus"

// netSyncCollector turns the syncer's status into metrics at each scrape:
// the syncer owns the figures, nothing here keeps a copy.
type netSyncCollector struct {
	ns                                                    *netSyncService
	networks, conflicts, kept, created, removed, requests *prometheus.Desc
	dropped                                               *prometheus.Desc
}

func newNetSyncCollector(ns *netSyncService) *netSyncCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("overlayd_netsync_"+name, help, labels, nil)
	}
	return &netSyncCollector{ns: ns,
		networks:  d("networks", "Networks defined once known to this host, by state (live, removed: a tombstone).", "state"),
		conflicts: d("conflicts", "Networks of this host whose definition differs from the cluster's, left alone."),
		kept:      d("kept", "Networks removed in the cluster that this host keeps while containers use them."),
		created:   d("replicas_created_total", "Replicas created through the local engine since start."),
		removed:   d("replicas_removed_total", "Idle replicas removed through the local engine since start."),
		requests:  d("engine_requests_total", "Engine API requests netsync made since start."),
		dropped:   d("messages_dropped_total", "netsync messages dropped (a full queue); anti-entropy repairs them."),
	}
}

func (c *netSyncCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.networks, c.conflicts, c.kept, c.created, c.removed, c.requests, c.dropped} {
		ch <- d
	}
}

// Collect reports nothing until the syncer runs (it waits for the engine).
func (c *netSyncCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.ns.status()
	if st == nil {
		return
	}
	live := st.Live()
	ch <- prometheus.MustNewConstMetric(c.networks, prometheus.GaugeValue, float64(live), "live")
	ch <- prometheus.MustNewConstMetric(c.networks, prometheus.GaugeValue, float64(len(st.Entries)-live), "removed")
	ch <- prometheus.MustNewConstMetric(c.conflicts, prometheus.GaugeValue, float64(len(st.Conflicts)))
	ch <- prometheus.MustNewConstMetric(c.kept, prometheus.GaugeValue, float64(len(st.Kept)))
	ch <- prometheus.MustNewConstMetric(c.created, prometheus.CounterValue, float64(st.Created))
	ch <- prometheus.MustNewConstMetric(c.removed, prometheus.CounterValue, float64(st.Removed))
	ch <- prometheus.MustNewConstMetric(c.requests, prometheus.CounterValue, float64(st.EngineCalls))
	ch <- prometheus.MustNewConstMetric(c.dropped, prometheus.CounterValue, float64(st.Dropped))
}
