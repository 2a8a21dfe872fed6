package backoff

import (
	"context"
	"math"
	"testing"
	"testing/synctest"
	"time"
)

func TestPow(t *testing.T) {
	for _, c := range []struct {
		base, limit time.Duration
		factor      float64
		n           int
		want        time.Duration
	}{
		{time.Second, 2 * time.Minute, 5, 1, time.Second},
		{time.Second, 2 * time.Minute, 5, 2, 5 * time.Second},
		{time.Second, 2 * time.Minute, 5, 3, 25 * time.Second},
		{time.Second, 2 * time.Minute, 5, 4, 2 * time.Minute},
		{time.Second, time.Minute, 2, 3, 4 * time.Second},
		{time.Second, time.Minute, 1.5, 3, 2250 * time.Millisecond},
		{time.Second, time.Minute, 1, 50, time.Second},
		{time.Minute, time.Second, 2, 1, time.Second},
		{time.Second, math.MaxInt64, 10, 1 << 30, math.MaxInt64}, // no overflow
		{0, time.Minute, 2, 5, 0},
	} {
		if got := Pow(c.base, c.limit, c.factor, c.n); got != c.want {
			t.Errorf("Pow(%v, %v, %v, %d) = %v, want %v", c.base, c.limit, c.factor, c.n, got, c.want)
		}
	}
}

func TestJitterBounds(t *testing.T) {
	const d = time.Second
	for range 1000 {
		if s := Spread(d); s < 8*d/10 || s > 12*d/10 {
			t.Fatalf("Spread(%v) = %v, outside ±20%%", d, s)
		}
		if f := Full(d); f < 0 || f > d {
			t.Fatalf("Full(%v) = %v, outside [0, d]", d, f)
		}
		if u := Upper(d); u < d/2 || u > d {
			t.Fatalf("Upper(%v) = %v, outside [d/2, d]", d, u)
		}
	}
	if Full(0) != 0 || Upper(-1) != 0 {
		t.Fatal("a delay of at most 0 is not 0")
	}
}

func TestGrowing(t *testing.T) {
	g := Growing{Min: time.Second, Max: 4 * time.Second}
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second} {
		if d := g.Next(); d < 8*want/10 || d > 12*want/10 {
			t.Fatalf("delay %d: %v, want %v ±20%%", i, d, want)
		}
	}
	g.Reset()
	if d := g.Next(); d > 12*time.Second/10 {
		t.Fatalf("after Reset: %v, want Min", d)
	}
	g = Growing{Min: time.Second, Max: 20 * time.Second, Factor: 3}
	for i, want := range []time.Duration{time.Second, 3 * time.Second, 9 * time.Second, 20 * time.Second, 20 * time.Second} {
		if d := g.Next(); d < 8*want/10 || d > 12*want/10 {
			t.Fatalf("factor 3, delay %d: %v, want %v ±20%%", i, d, want)
		}
	}
}

func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if !Sleep(t.Context(), time.Minute) || time.Since(start) != time.Minute {
			t.Fatal("Sleep did not wait its duration")
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		if Sleep(ctx, time.Hour) || time.Since(start) != time.Minute+time.Second {
			t.Fatal("Sleep outlived its context")
		}
		if Sleep(ctx, 0) {
			t.Fatal("Sleep with a done context reported that it waited")
		}
		if !Sleep(t.Context(), 0) {
			t.Fatal("Sleep(0) did not return at once")
		}
	})
}
