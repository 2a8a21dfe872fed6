package idemwatermill

// PoisonError is the middleware's error for a poison message, for the tests.
type PoisonError = poisonError
