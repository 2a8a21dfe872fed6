package defaults

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestChecker(t *testing.T) {
	var (
		d  time.Duration
		n  int
		n8 int64
		f  float64
	)
	c := New("pkg: Options")
	c.Duration("D", &d, time.Second)
	c.Int("N", &n, 3)
	c.Int64("N8", &n8, 4)
	c.Factor("F", &f, 2)
	c.NotNegative("Z", 0)
	c.Order("D", d, "D", d)
	if err := c.Err(); err != nil || d != time.Second || n != 3 || n8 != 4 || f != 2 {
		t.Fatalf("zero fields: %v %v %v %v, err %v", d, n, n8, f, err)
	}
	d, n = 5*time.Second, 7
	c.Duration("D", &d, time.Second)
	c.Int("N", &n, 3)
	if d != 5*time.Second || n != 7 {
		t.Fatalf("set fields changed: %v %v", d, n)
	}
}

func TestCheckerErrors(t *testing.T) {
	for want, check := range map[string]func(c *Checker){
		"pkg: Options.D is -1s; it must be positive (or zero for 1s)": func(c *Checker) {
			d := -time.Second
			c.Duration("D", &d, time.Second)
		},
		"pkg: Options.N is -1; it must be positive (or zero for 3)": func(c *Checker) {
			n := -1
			c.Int("N", &n, 3)
		},
		"pkg: Options.N8 is -2; it must be positive (or zero for 4)": func(c *Checker) {
			n := int64(-2)
			c.Int64("N8", &n, 4)
		},
		"pkg: Options.F is 0.5; it must be at least 1 (or zero for 2)": func(c *Checker) {
			f := 0.5
			c.Factor("F", &f, 2)
		},
		"pkg: Options.F is NaN; it must be at least 1 (or zero for 2)": func(c *Checker) {
			f := math.NaN()
			c.Factor("F", &f, 2)
		},
		"pkg: Options.W is -1ms; it must not be negative": func(c *Checker) {
			c.NotNegative("W", -time.Millisecond)
		},
		"pkg: Options.Lo (2s) is greater than Hi (1s)": func(c *Checker) {
			c.Order("Lo", 2*time.Second, "Hi", time.Second)
		},
		"pkg: Options.Sub: boom": func(c *Checker) {
			c.Wrap("Sub", errors.New("boom"))
		},
	} {
		c := New("pkg: Options")
		check(c)
		// The first error is kept; later checks do not replace it.
		n := -5
		c.Int("Later", &n, 1)
		if err := c.Err(); err == nil || err.Error() != want {
			t.Errorf("got %v, want %q", err, want)
		}
		if n != -5 {
			t.Errorf("a check after an error changed its field")
		}
	}
	if err := New("").Err(); err != nil {
		t.Fatal(err)
	}
	c := New("")
	n := -1
	c.Int("N", &n, 1)
	if err := c.Err(); err == nil || !strings.HasPrefix(err.Error(), "N is -1") {
		t.Fatalf("empty prefix: %v", err)
	}
}
