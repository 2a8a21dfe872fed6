package httpidem

// For the tests: the signature check of the webhook handler and its errors.
var (
	VerifySignature      = verifySignature
	ErrSignatureMismatch = errSignatureMismatch
	ErrSignatureStale    = errSignatureStale
	KeyFrom              = keyFrom
	ContentTypeProblem   = contentTypeProblem
)
