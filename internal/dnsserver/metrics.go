package dnsserver

import (
	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
)

// Results of cluster answers and forwards (the metrics' label values).
const (
	resultAnswer = "answer" // a cluster name with addresses of the asked type
	resultNoData = "nodata" // a cluster name without addresses of the asked type

	forwardOK       = "ok"       // an upstream answered (not NXDOMAIN)
	forwardNXDomain = "nxdomain" // an upstream answered NXDOMAIN
	forwardFailed   = "failed"   // no upstream, or none answered in time: SERVFAIL
	forwardOverload = "overload" // MaxForwards in flight: SERVFAIL without asking
)

// collector is the server's instruments. Queries are labelled by network
// (a host has tens of networks, not thousands); everything else is not, so
// that the series stay few.
type collector struct {
	queries  *prometheus.CounterVec
	dropped  prometheus.Counter
	results  *prometheus.CounterVec
	errors   *prometheus.CounterVec
	forwards *prometheus.CounterVec
	latency  prometheus.Histogram
	all      []prometheus.Collector
}

func newCollector() *collector {
	c := &collector{
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_dns_queries_total",
			Help: "DNS requests received with a readable header (not dropped), by listener: network (a sandbox's, from its containers), host (the host's, forward only).",
		}, []string{"listener"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "overlayd_dns_dropped_total",
			Help: "DNS packets dropped without an answer: shorter than a header, or responses.",
		}),
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_dns_cluster_answers_total",
			Help: "Queries for cluster names, by result: answer (addresses of the asked type), nodata (none of that type).",
		}, []string{"result"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_dns_errors_total",
			Help: "Error responses the server made itself, by rcode (formerr, refused: a class other than IN, notimp: an opcode other than QUERY, servfail: a forward that failed or was not attempted).",
		}, []string{"rcode"}),
		forwards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_dns_forwards_total",
			Help: "Queries for names that are not cluster names, by result (ok, nxdomain: the upstream's answers; failed: no upstream answered; overload: too many forwards in flight).",
		}, []string{"result"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "overlayd_dns_forward_duration_seconds",
			Help: "How long forwarded queries took, until an upstream's answer or the failure.",
			// A LAN resolver answers in under a millisecond, a cached
			// public one in tens; seconds are timeouts.
			Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5},
		}),
	}
	for _, r := range []string{resultAnswer, resultNoData} {
		c.results.WithLabelValues(r)
	}
	for _, r := range []string{"formerr", "refused", "notimp", "servfail"} {
		c.errors.WithLabelValues(r)
	}
	for _, r := range []string{forwardOK, forwardNXDomain, forwardFailed, forwardOverload} {
		c.forwards.WithLabelValues(r)
	}
	c.all = []prometheus.Collector{c.queries, c.dropped, c.results, c.errors, c.forwards, c.latency}
	return c
}

func (c *collector) countRcode(rcode int) {
	var l string
	switch rcode {
	case dns.RcodeFormatError:
		l = "formerr"
	case dns.RcodeRefused:
		l = "refused"
	case dns.RcodeNotImplemented:
		l = "notimp"
	case dns.RcodeServerFailure:
		l = "servfail"
	default:
		return
	}
	c.errors.WithLabelValues(l).Inc()
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, x := range c.all {
		x.Describe(ch)
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	for _, x := range c.all {
		x.Collect(ch)
	}
}
