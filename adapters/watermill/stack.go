package idemwatermill

// Watermill's router runs each message's handler on a goroutine of its own,
// which starts with a small stack (the runtime sizes new stacks after the
// average goroutine's). A handler that needs more (decoding JSON, calling a
// driver) makes the runtime allocate a stack twice the size and copy the
// old one into it, adjusting every frame on it: the deeper the call that
// runs out, the more frames to adjust, and that copy can cost as much as
// the claim. Dedup grows the stack at its start instead, while the
// goroutine holds only the router's few frames, so that the claim and the
// handler below it run on a stack that does not need to grow in the common
// case. On a goroutine whose stack is already large enough, growStack only
// zeroes its reserve.

// stackReserve is how much free stack growStack makes sure of: with the
// router's frames above it, the goroutine ends up with a 16 KiB stack
// (stacks come in powers of two), the largest size the runtime keeps in its
// per-P caches, so taking and freeing one stays cheap.
const stackReserve = 9 << 10

// stackIndex is always 0; growStack reads its reserve at it so that the
// compiler cannot drop the reserve.
var stackIndex int

// growStack makes sure the goroutine's stack has stackReserve bytes free
// below the caller, growing it now if not. It returns 0.
//
//go:noinline
func growStack() byte {
	var reserve [stackReserve]byte
	return reserve[stackIndex]
}
