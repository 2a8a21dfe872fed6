package consumer

// The error types of the Timeout and DeadLetter middleware, for the tests.
type (
	TimeoutError      = timeoutError
	DeadLetteredError = deadLetteredError
)
