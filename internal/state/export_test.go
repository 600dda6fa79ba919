package state

// For the external tests: how many steps the fault injection has (FailStep numbers
// 1..n), read from the step tables so that a new step is injected too.
var (
	CheckpointStepCount = len(checkpointSteps)
	RestoreStepCount    = len(restoreSteps)
)
