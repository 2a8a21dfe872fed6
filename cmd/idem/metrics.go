package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
)

// metricsServer serves a command's OpenTelemetry metrics in the Prometheus
// text format (GET /metrics) and its liveness (GET /healthz). The metrics
// go through the OpenTelemetry Prometheus exporter into a registry of its
// own, with the Go runtime and process collectors. A nil *metricsServer
// is valid and does nothing: its meterProvider is nil (the global one).
type metricsServer struct {
	mp      *sdkmetric.MeterProvider
	reg     *prometheus.Registry
	running atomic.Bool
	ln      net.Listener
}

// newMetricsServer creates the registry, the exporter and the provider;
// service is the service.name resource attribute (target_info).
func newMetricsServer(service string) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", service)))
	if err != nil {
		res = resource.Default()
	}
	return &metricsServer{
		mp:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp), sdkmetric.WithResource(res)),
		reg: reg,
	}, nil
}

// meterProvider is the provider to hand to idem's components; nil (the
// OpenTelemetry global) for a nil server.
func (s *metricsServer) meterProvider() metric.MeterProvider {
	if s == nil {
		return nil
	}
	return s.mp
}

func (s *metricsServer) setRunning(v bool) {
	if s != nil {
		s.running.Store(v)
	}
}

func (s *metricsServer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.running.Load() {
			http.Error(w, "stopping", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	return mux
}

// serve listens on addr and serves in a goroutine that the returned stop
// function shuts down and joins.
func (s *metricsServer) serve(addr string) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s.ln = ln
	srv := &http.Server{Handler: s.handler(), ReadHeaderTimeout: 5 * time.Second}
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) }) // ends with ErrServerClosed at Shutdown
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		wg.Wait()
	}, nil
}

// addr is the address served on, once serve succeeded.
func (s *metricsServer) addr() string {
	if s == nil || s.ln == nil {
		return ""
	}
	return s.ln.Addr().String()
}

// shutdown stops the provider (and its exporter).
func (s *metricsServer) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.mp.Shutdown(ctx)
}
