//! Snapshots: a saved and loaded trainer resumes identically.

use super::*;

#[test]
fn save_and_load_resume_identically() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = weights(1.0, 1.0, 1.0, 1.0);
    let batch = vec![
        example(6, true, true, Some(false)),
        example(7, false, true, Some(true)),
    ];
    let mut a = Trainer::new(model(), cfg.clone(), "p").unwrap();
    for _ in 0..3 {
        a.step(&batch).unwrap();
    }
    a.save(dir.path()).unwrap();
    let mut b = Trainer::new(model(), cfg, "p").unwrap();
    b.load(dir.path()).unwrap();
    assert_eq!(a.state(), b.state());
    let ra = a.step(&batch).unwrap();
    let rb = b.step(&batch).unwrap();
    assert_eq!(ra.loss, rb.loss);
    for (k, t) in a.policy().tensors().unwrap() {
        let d = (t - &b.policy().tensors().unwrap()[&k])
            .unwrap()
            .abs()
            .unwrap();
        assert_eq!(d.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{k}");
    }
}
