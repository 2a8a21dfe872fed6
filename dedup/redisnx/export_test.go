package redisnx

// MaxInFlight is maxInFlight, for the tests of package redisnx_test that
// fill every slot of a group.
const MaxInFlight = maxInFlight
