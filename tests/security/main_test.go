package security

import (
	"os"
	"testing"

	"deltabox/internal/testutil"
)

// TestMain removes the daemon binary the tests built (testutil.Main).
func TestMain(m *testing.M) { os.Exit(testutil.Main(m)) }
