package state

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"deltabox/internal/store"
)

// fill sets every field of the struct v points to (recursively, pointers allocated) to a
// non-zero value.
func fill(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(v.Elem())
	case reflect.Struct:
		if v.Type() == reflect.TypeOf(time.Time{}) {
			v.Set(reflect.ValueOf(time.Date(2026, 12, 1, 0, 0, 0, 1, time.UTC)))
			return
		}
		for i := 0; i < v.NumField(); i++ {
			fill(v.Field(i))
		}
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int32, reflect.Int64:
		v.SetInt(-3)
	case reflect.Uint, reflect.Uint32, reflect.Uint64:
		v.SetUint(3)
	case reflect.Float64:
		v.SetFloat(1.5)
	}
}

// TestAPIRecordsCopyEveryField: apiNode and apiSandbox show every field of the index's
// records (store.Node, store.Sandbox), and the API's types have none the records lack:
// a field added to one side only fails here, to be added to the other or left out on
// purpose.
func TestAPIRecordsCopyEveryField(t *testing.T) {
	var n store.Node
	fill(reflect.ValueOf(&n).Elem())
	var sb store.Sandbox
	fill(reflect.ValueOf(&sb).Elem())
	for _, c := range []struct {
		name      string
		rec, wire any
	}{{"node", n, apiNode(n)}, {"sandbox", sb, apiSandbox(sb)}} {
		r, _ := json.Marshal(c.rec)
		w, _ := json.Marshal(c.wire)
		if string(r) != string(w) {
			t.Errorf("%s: the record %s shows as %s", c.name, r, w)
		}
	}
}
