//go:build !unix

package chaos

// registerPartition registers nothing where network namespaces do not
// exist.
func registerPartition() {}
