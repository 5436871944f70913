"""`tessera bench`: scenarios that replay traces through the simulator or a real engine and compare
policies side by side, with their runner, real-engine measurements and machine-stall watch."""
