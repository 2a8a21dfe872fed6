// Package defaults fills and checks the fields of idem's options structs, so
// that every constructor treats them alike: a zero field takes its
// default, a negative one is refused with an error that names the field
// and says what zero would have given.
package defaults

import (
	"fmt"
	"math"
	"time"
)

// Checker fills the fields of one options struct and keeps the first
// error. Its methods do nothing once an error is kept.
type Checker struct {
	prefix string
	err    error
}

// New returns a Checker whose errors start with prefix, the struct's name
// as the user writes it ("kafka: ConsumerOptions").
func New(prefix string) *Checker { return &Checker{prefix: prefix} }

// Err returns the first error kept, or nil.
func (c *Checker) Err() error { return c.err }

// Fail keeps the error "<prefix>.<field> <text>" ("<field> <text>" with
// an empty prefix) unless one is kept already; text is formatted with
// args.
func (c *Checker) Fail(field, text string, args ...any) {
	if c.err == nil {
		c.err = fmt.Errorf("%s %s", c.name(field), fmt.Sprintf(text, args...))
	}
}

func (c *Checker) name(field string) string {
	if c.prefix == "" {
		return field
	}
	return c.prefix + "." + field
}

// Wrap keeps err, wrapped as "<prefix>.<field>: err", unless err is nil
// or an error is kept already.
func (c *Checker) Wrap(field string, err error) {
	if c.err == nil && err != nil {
		c.err = fmt.Errorf("%s: %w", c.name(field), err)
	}
}

// Duration sets *v to def when it is zero and refuses a negative *v.
func (c *Checker) Duration(field string, v *time.Duration, def time.Duration) {
	if c.err != nil {
		return
	}
	if *v < 0 {
		c.Fail(field, "is %v; it must be positive (or zero for %v)", *v, def)
		return
	}
	if *v == 0 {
		*v = def
	}
}

// Int sets *v to def when it is zero and refuses a negative *v.
func (c *Checker) Int(field string, v *int, def int) {
	if c.err != nil {
		return
	}
	if *v < 0 {
		c.Fail(field, "is %d; it must be positive (or zero for %d)", *v, def)
		return
	}
	if *v == 0 {
		*v = def
	}
}

// Int64 sets *v to def when it is zero and refuses a negative *v.
func (c *Checker) Int64(field string, v *int64, def int64) {
	if c.err != nil {
		return
	}
	if *v < 0 {
		c.Fail(field, "is %d; it must be positive (or zero for %d)", *v, def)
		return
	}
	if *v == 0 {
		*v = def
	}
}

// NotNegative refuses a negative v (an int, int64 or time.Duration) and
// leaves zero alone: for a field whose zero is a setting of its own, or
// whose default depends on other fields.
func (c *Checker) NotNegative(field string, v any) {
	if c.err != nil {
		return
	}
	neg := false
	switch x := v.(type) {
	case int:
		neg = x < 0
	case int64:
		neg = x < 0
	case time.Duration:
		neg = x < 0
	default:
		panic(fmt.Sprintf("defaults: NotNegative of a %T", v))
	}
	if neg {
		c.Fail(field, "is %v; it must not be negative", v)
	}
}

// Factor sets *v to def when it is zero and refuses a value below 1, NaN
// or infinite.
func (c *Checker) Factor(field string, v *float64, def float64) {
	if c.err != nil {
		return
	}
	if *v == 0 {
		*v = def
	}
	if *v < 1 || math.IsNaN(*v) || math.IsInf(*v, 0) {
		c.Fail(field, "is %v; it must be at least 1 (or zero for %v)", *v, def)
	}
}

// Order refuses lo above hi: two fields where the first must not exceed
// the second.
func (c *Checker) Order(loField string, lo time.Duration, hiField string, hi time.Duration) {
	if c.err == nil && lo > hi {
		c.Fail(loField, "(%v) is greater than %s (%v)", lo, hiField, hi)
	}
}
